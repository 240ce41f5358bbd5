from setuptools import find_packages, setup

setup(
    name="triforce-runtime",
    version="0.1.0",
    description="Lossless hierarchical speculative decoding (TriForce) for long-context Llama-family models",
    python_requires=">=3.10",
    packages=find_packages(include=["triforce", "triforce.*"]),
    package_data={"triforce": ["data/*.txt", "model/csrc/*.h", "model/csrc/*.cpp"]},  # the CPU kernels' C++
    install_requires=[
        "torch>=2.4",  # CI pins the CPU build: pip install torch==2.13.0 first
        "transformers>=4.45",
        "safetensors>=0.4",
        "tokenizers>=0.19",
        "numpy",
        "rich>=13",
        "ninja",  # torch builds the CPU decode-attention kernels with it (model/decode_attention.py)
    ],
    extras_require={
        "gpu": ["flash-attn>=2.6", "nvidia-ml-py>=12"],
        "convert": ["gguf>=0.10", "accelerate>=0.30", "sentencepiece"],
        "bench": ["matplotlib>=3.7"],
        "deepspeed": ["deepspeed>=0.14"],
        "test": ["pytest>=8", "hypothesis>=6", "pytest-timeout"],
    },
    entry_points={
        "console_scripts": [
            "triforce-generate=triforce.cli.entry:generate",
            "triforce-chat=triforce.cli.entry:chat",
            "triforce-prepare=triforce.cli.entry:prepare",
            "triforce-tp=triforce.cli.entry:tp",
        ],
    },
)
