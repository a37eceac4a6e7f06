import pytest
import torch

from atom.models.deepseek_v41.model import DeepseekV41ForCausalLM
from atom.models.deepseek_v41.presets import preset_config


@pytest.fixture(scope="session")
def tiny_config():
    return preset_config("v41-tiny")


@pytest.fixture(scope="session")
def tiny_model(tiny_config):
    torch.manual_seed(0)
    return DeepseekV41ForCausalLM(tiny_config, kv_dtype="fp32", index_dtype="fp32").init_weights(0)
