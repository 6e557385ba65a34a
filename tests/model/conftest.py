import pytest
import transformers

from shiftlm.tools.parity import reference_outputs
from shiftlm.tools.tiny import TINY_FAMILIES, make_tiny_checkpoint

transformers.logging.set_verbosity_error()
transformers.logging.disable_progress_bar()


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory):
    """family -> directory of a tiny real HF checkpoint written by `transformers`."""
    root = tmp_path_factory.mktemp("tiny")
    return {family: str(make_tiny_checkpoint(root / family, family)) for family in TINY_FAMILIES}


@pytest.fixture(scope="session")
def hf_reference(tiny_checkpoints):
    cache = {}

    def get(family):
        if family not in cache:
            cache[family] = reference_outputs(tiny_checkpoints[family], param_grads=True)
        return cache[family]

    return get
