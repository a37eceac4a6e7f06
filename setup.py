from setuptools import find_packages, setup

setup(
    name="atom",
    version="0.1.0",
    description="A native LLM inference engine for DeepSeek-V4.1 models with LMCache MP offload",
    packages=find_packages(include=["atom", "atom.*"]),
    package_data={"atom": ["byte_tokenizer/*.json"]},  # the presets' tokenizer, for clients
    python_requires=">=3.10",
    install_requires=[
        "torch>=2.4",
        "lmcache==0.5.6",
        "pydantic>=2",
        "pyyaml",
        "safetensors",
        "xxhash",
        "msgspec>=0.18",  # KV events (atom.kv_events); lmcache depends on both too
        "pyzmq>=25",
        "tokenizers",
        "fastapi",
        "uvicorn",
        "prometheus_client",
    ],
    extras_require={
        "dev": ["pytest", "pytest-timeout", "pytest-xdist", "ruff", "black", "openai", "httpx"],
        # tests/serve/test_lm_eval.py (skipped without it); .ci/run installs it
        "eval": ["lm-eval[api]==0.4.13"],
    },
)
