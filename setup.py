"""glmjax: a JAX inference runtime for GLM-5-class MoE models that do not fit in accelerator memory."""

from setuptools import find_packages, setup

setup(
    name="glmjax",
    version="0.1.0",
    description="JAX inference runtime for GLM-5 (glm_moe_dsa) MoE models with expert offload",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["glmjax", "glmjax.*", "pallas_kernels", "pallas_kernels.*"]),
    include_package_data=True,
    package_data={"glmjax": ["embedded_model/*", "studies/*.json"]},
    install_requires=[
        # Capped at the newest release tested: pallas_kernels/cpu_ffi.py reads XLA's FFI call frame
        # at word offsets checked against jaxlib 0.10.2 (it self-tests and falls back if they move).
        "jax>=0.10,<=0.10.2",
        "numpy>=1.26",
        # Below 0.7: 0.7.0 adds its many ufunc loops through numpy's PyUFunc_AddLoop, whose
        # linear search makes its import quadratic, paid by every process (DESIGN.md §4).
        "ml_dtypes>=0.5,<0.7",
        "safetensors>=0.4",
        "tensorstore>=0.1.70",
        "crc32c>=2.4",  # the engine's direct chunk reads check the store's crc32c
        "orbax-checkpoint>=0.11",
        "tokenizers>=0.20",
        "jinja2>=3.1",
        "absl-py>=2.0",
        "tqdm>=4.66",
        "psutil>=5.9",
        "optax>=0.2",
        "numba>=0.60",
        "matplotlib>=3.8",
        "starlette>=0.40",  # the OpenAI-compatible server (glmjax.serving) and its ASGI server
        "uvicorn>=0.30",
        # Structured output (glmjax.decoding.grammar): token masks for JSON schemas and GLM's
        # tool-call layout, computed lazily per step, so a schema new to the server costs ms.
        "llguidance>=1.9,<2",
    ],
    extras_require={
        # The reference implementation for parity tests: transformers' GlmMoeDsaForCausalLM on a
        # CPU build of torch. Test-only; the runtime never imports them.
        # pytest-xdist: the suite runs on two workers, a file per worker (module fixtures stay
        # built once). nbclient + ipykernel execute notebooks/quickstart.ipynb in a kernel;
        # matplotlib draws its inline plot (also a runtime dependency, listed so the notebook
        # test's needs stand together). openai, anthropic and lm-eval (its API models): clients
        # no one here wrote, which the server is tested with (anthropic ≥ 2: the SDK whose
        # dated anthropic-version header the tests meet); jsonschema checks tool-call arguments
        # against their schema independently of the server; pydantic: the models
        # `chat.completions.parse` reads replies into; schemathesis fuzzes the server from its
        # own /openapi.json (scripts/fuzz_server.py).
        "test": ["pytest>=8", "pytest-xdist>=3.5", "transformers>=5.2", "torch==2.13.0",
                 "nbclient>=0.10", "ipykernel>=6.29", "matplotlib>=3.8", "openai>=1.40",
                 "pydantic>=2", "anthropic>=2.0", "jsonschema>=4.0", "lm-eval[api]==0.4.13",
                 "schemathesis>=4.0"],
    },
)
