"""The one native piece: non-temporal block copies (``_stream_copy.c``). Optional: without
a C compiler the package installs anyway and copies with memmove per range
(`stream_copy.NATIVE` says which)."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "vllm_qaic_connector.kv._stream_copy",
            ["vllm_qaic_connector/kv/_stream_copy.c"],
            extra_compile_args=["-O3"],
            optional=True,
        )
    ]
)
