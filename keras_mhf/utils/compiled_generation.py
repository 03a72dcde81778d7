"""Compiling a generation function of a causal LM as KerasHub compiles
`generate` (`CausalLM.make_generate_function`), for streaming generation
(`keras_mhf.models.generation_stream`): backend-specific code, kept out of
models/."""

import itertools

import keras


def compile_like_generate(causal_lm, sampler, function):
    """`function` compiled as `generate` is: `jax.jit` over the model's and
    the sampler's state (KerasHub's `make_generate_function`),
    `tf.function` (with the model's `jit_compile`), eagerly on PyTorch."""
    backend = keras.config.backend()
    if backend == "tensorflow" and not causal_lm.run_eagerly:
        import tensorflow as tf

        return tf.function(
            function, jit_compile=getattr(causal_lm, "jit_compile", True)
        )
    if backend != "jax" or causal_lm.run_eagerly:
        return function
    import jax

    # Listed once: walking the layers for them on every call costs more
    # than a short chunk's steps (streaming keys its compiled functions by
    # the model's weights, so new weights compile new ones).
    sampler_variables = list(sampler.variables)
    trainable = list(causal_lm.trainable_variables)
    non_trainable = list(causal_lm.non_trainable_variables)

    def stateless(state, *args):
        sampler_values, trainable_values, non_trainable_values = state
        mapping = itertools.chain(
            zip(sampler_variables, sampler_values),
            zip(trainable, trainable_values),
            zip(non_trainable, non_trainable_values),
        )
        with keras.StatelessScope(state_mapping=mapping) as scope:
            outputs = function(*args)
        sampler_values = []
        for v in sampler_variables:
            new = scope.get_current_value(v)
            sampler_values.append(v.value if new is None else new)
        return outputs, sampler_values

    jitted = jax.jit(stateless)

    def call(*args):
        state = (
            [v.value for v in sampler_variables],
            [v.value for v in trainable],
            [v.value for v in non_trainable],
        )
        outputs, sampler_values = jitted(state, *args)
        for variable, value in zip(sampler_variables, sampler_values):
            variable.assign(value)
        return outputs

    return call
