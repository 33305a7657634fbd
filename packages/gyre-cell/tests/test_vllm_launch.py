"""How a vLLM server is started (the live server: tests/test_vllm.py)."""

import pytest

from gyre_cell.vllm_launch import (
    EXTENSION_CLASS,
    EXTENSION_DIR,
    VLLMLaunchConfig,
    build_launch_command,
    launch_env,
)


def test_the_command_runs_the_api_server_module_with_scale_out_and_the_extension():
    cfg = VLLMLaunchConfig(
        model_path="/m", python="/py", port=9001, dtype="float32", max_model_len=2048, seed=3
    )
    cmd = build_launch_command(cfg)
    assert cmd[:5] == ["/py", "-m", "vllm.entrypoints.openai.api_server", "--model", "/m"]
    assert "--enable-scale-out" in cmd and cmd[cmd.index("--worker-extension-cls") + 1] == EXTENSION_CLASS
    assert cmd[cmd.index("--port") + 1] == "9001" and cmd[cmd.index("--max-model-len") + 1] == "2048"
    assert cmd[cmd.index("--stream-interval") + 1] == "16"  # one event per token starved concurrent calls
    assert (EXTENSION_DIR / (EXTENSION_CLASS.split(".")[0] + ".py")).is_file()


def test_the_key_goes_by_environment_never_argv():
    cfg = VLLMLaunchConfig(model_path="/m")
    env = launch_env(cfg, "s3cret", base={"PYTHONPATH": "/gyre", "VIRTUAL_ENV": "/v", "HOME": "/h"})
    assert env["VLLM_API_KEY"] == "s3cret" and "s3cret" not in " ".join(build_launch_command(cfg))
    assert env["PYTHONPATH"] == str(EXTENSION_DIR) and "VIRTUAL_ENV" not in env and env["HOME"] == "/h"
    assert env["VLLM_SERVER_DEV_MODE"] == "1" and env["HF_HUB_OFFLINE"] == "1"
    assert "VLLM_API_KEY" not in launch_env(cfg, None, base={"VLLM_API_KEY": "inherited"})
    with pytest.raises(ValueError, match="argv"):
        build_launch_command(cfg.model_copy(update={"extra_args": ("--api-key", "x")}))
    with pytest.raises(ValueError, match="one non-empty line"):
        launch_env(cfg, "a\nb")
