"""Evaluation of MultiHashFormer and Standard causal LMs as lm-eval computes
it: `scoring` (log-likelihoods, perplexity), `tasks` (LAMBADA, multiple
choice), `card660` (rare-word similarity), `runner` (a preset on task
files, resumable), `evaluation_results` (the per-example results file),
`calibration` (the scoring temperature) and `lm_eval_adapter` (lm-eval's
model interface)."""

from keras_mhf.evaluation.calibration import calibrate
from keras_mhf.evaluation.calibration import expected_calibration_error
from keras_mhf.evaluation.card660 import last_token_hidden_states
from keras_mhf.evaluation.card660 import pearson
from keras_mhf.evaluation.card660 import rare_word_similarity
from keras_mhf.evaluation.card660 import spearman
from keras_mhf.evaluation.evaluation_results import EvaluationResults
from keras_mhf.evaluation.runner import evaluate_preset
from keras_mhf.evaluation.scoring import block_scores
from keras_mhf.evaluation.scoring import document_likelihood
from keras_mhf.evaluation.scoring import encode_documents
from keras_mhf.evaluation.scoring import encode_pair
from keras_mhf.evaluation.scoring import encoded_document_likelihood
from keras_mhf.evaluation.scoring import loglikelihoods
from keras_mhf.evaluation.scoring import next_token_scores
from keras_mhf.evaluation.scoring import paper_rule
from keras_mhf.evaluation.scoring import perplexity
from keras_mhf.evaluation.scoring import perplexity_details
from keras_mhf.evaluation.scoring import reference_next_token_scores
from keras_mhf.evaluation.scoring import token_log_likelihoods
from keras_mhf.evaluation.tasks import TaskFileError
from keras_mhf.evaluation.tasks import TaskFileWarning
from keras_mhf.evaluation.tasks import lambada
from keras_mhf.evaluation.tasks import multiple_choice
from keras_mhf.evaluation.tasks import read_task_file
from keras_mhf.evaluation.tasks import write_last_word_file
