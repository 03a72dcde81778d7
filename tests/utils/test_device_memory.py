"""`device_memory`: what the backend computes on, and its memory."""

from keras_mhf.utils import device_memory


def test_a_cpu_reports_no_accelerator_memory():
    """This machine has no accelerator: every backend says so, and the
    fused head keeps its CPU blocks."""
    assert device_memory.device_info() == ("cpu", "cpu", None)
    assert device_memory.accelerator_memory_bytes() is None
