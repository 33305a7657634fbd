"""Test doubles that are documented features of gyre-cell: `sglang_stand_in`, the CPU torch engine behind
SGLang's launch flags, where SGLang cannot run (`[rollout.sglang] module`)."""

__all__: list[str] = []
