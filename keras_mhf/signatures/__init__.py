"""Multi-hash signatures (paper Sec. 3.1): every token string gets `H`
bucket ids; `SignatureTable` holds them for a vocabulary, and
`signature_lsh` gives the authors' LSH heads (their Sec. 6 ablation)."""

from keras_mhf.signatures.signature_table import SignatureTable
