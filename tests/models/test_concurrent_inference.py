"""Public inference methods called from several threads on one model: every
call succeeds with the numbers of a call made alone (on JAX, Keras'
compiled predict donates the model's buffers; `concurrent_inference`
serialises the calls), and outputs carry no autograd state on PyTorch."""

import threading

import keras
import numpy as np
import pytest
from keras import ops

from keras_mhf.evaluation import loglikelihoods


def to_numpy(x):
    return np.asarray(ops.convert_to_numpy(x))


@pytest.fixture(scope="module")
def lm(small_proto):
    from keras_mhf.models import MultiHashFormerCausalLM
    from keras_mhf.models import MultiHashFormerTokenizer

    keras.utils.set_random_seed(0)
    lm = MultiHashFormerCausalLM.from_tokenizer(
        MultiHashFormerTokenizer(small_proto), "tiny_h3b64", sequence_length=12
    )
    lm.compile(sampler="greedy")
    return lm


def test_calls_from_several_threads_succeed_with_the_same_numbers(lm):
    ids = np.array([[1, 5, 9, 13, 7, 2, 4, 8]] * 2)
    targets = np.roll(ids, -1, axis=1)
    requests = [("The cell is", " the unit"), ("Life", " is")]
    calls = {
        "loss": lambda: to_numpy(
            lm.score(ids, scoring_mode="loss", target_ids=targets)
        ),
        "logits": lambda: to_numpy(lm.score(ids)),
        "generate": lambda: lm.generate(["The cell", "Life"], max_length=12),
        "evaluation": lambda: loglikelihoods(
            lm, lm.preprocessor.tokenizer, requests, batch_size=2
        ),
    }
    expected = {name: call() for name, call in calls.items()}
    failures = []

    def worker(name):
        for _ in range(4):
            try:
                found = calls[name]()
                if name in ("generate", "evaluation"):
                    assert found == expected[name]
                else:
                    np.testing.assert_allclose(
                        found, expected[name], rtol=1e-5, atol=1e-6
                    )
            except Exception as error:  # collected, reported below
                failures.append(f"{name}: {error!r}"[:300])

    # The loss mode (JAX's donating compiled predict) against every other.
    names = ["loss", "loss", "logits", "generate", "evaluation"]
    threads = [threading.Thread(target=worker, args=(n,)) for n in names]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert failures == []


def test_scores_carry_no_autograd_state(lm):
    ids = np.array([[1, 5, 9, 13]])
    for out in (
        lm.score(ids),
        lm.score(ids, scoring_mode="loss", target_ids=np.roll(ids, -1, 1)),
    ):
        assert not getattr(out, "requires_grad", False)
        np.asarray(ops.convert_to_numpy(out))
        if keras.config.backend() == "torch":
            np.asarray(out)  # numpy() of a tensor that requires grad fails
