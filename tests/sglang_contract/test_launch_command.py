"""The command lines lit_parl's SGLang pool launches, parsed by SGLang's own parsers (sglang 0.5.23 and
sglang-router, as pinned in requirements.txt), without launching anything.

* Server: the pool starts with a launch command that only writes down its arguments and environment, then
  exits; each server's arguments go through ``sglang.srt.server_args.prepare_server_args`` (what
  ``python -m sglang.launch_server`` runs on ``sys.argv[1:]``) and must give the intended ``ServerArgs``
  (model, host, port per server, ``tp_size``, ``mem_fraction_static``, ``dtype``,
  ``enable_deterministic_inference``, extra ``LaunchSettings.args``), GPUs handed out through
  ``CUDA_VISIBLE_DEVICES``.
* The pool's ``dtype`` choices are SGLang's ``--dtype`` choices.
* The key the pool reads from ``/server_info`` to tell whether seeds are honoured is in what SGLang's
  ``/server_info`` reports (``build_server_info`` of those ``ServerArgs``).
* Router: ``router_command`` goes through sglang-router's ``parse_router_args``.
"""

from __future__ import annotations

import inspect
import json
import sys
import warnings

import pytest

from sglang_contract.sglang_side import require_sglang

require_sglang()

import sglang.launch_server  # noqa: E402
from sglang.srt.server_args import ServerArgs, prepare_server_args  # noqa: E402
from sglang.srt.utils.common import build_server_info  # noqa: E402
from sglang.srt.utils.msgspec_utils import msgspec_to_builtins  # noqa: E402
from sglang_router.launch_router import parse_router_args  # noqa: E402

from lit_parl.rollout.sglang import LaunchSettings, SGLangRolloutPool  # noqa: E402
from lit_parl.rollout.sglang.adapters import lora_launch_args  # noqa: E402
from lit_parl.rollout.sglang.commands import CPU_SERVER, router_command, server_command  # noqa: E402
from lit_parl.rollout.sglang.servers import Server, warn_unseeded  # noqa: E402
from lit_parl.rollout.sglang.settings import SERVER_DTYPES  # noqa: E402
from sglang_contract.pool_run import free_port  # noqa: E402

# a launch command that writes down what it was given, then exits (the pool then reports the exit)
# (a second later: the pool stops the servers it launched once one fails, and every server must have written)
WRITE_DOWN = """import json, os, sys, time
port = sys.argv[sys.argv.index("--port") + 1]
with open(os.path.join(sys.argv[1], f"server-{port}.json"), "w") as f:
    json.dump({"argv": sys.argv[2:], "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES")}, f)
time.sleep(1.0)
sys.exit(3)
"""


def test_the_default_launch_command_is_sglangs_launcher_parsing_its_arguments_with_prepare_server_args():
    launch = SGLangRolloutPool().launch
    assert server_command(launch, "m", 1, 1, False, cpu=False)[:3] == [sys.executable, "-m", "sglang.launch_server"]
    # on the CPU, the same launcher run by lit_parl's entry point (which mends the environment first)
    assert server_command(launch, "m", 1, 1, False, cpu=True)[:2] == [sys.executable, str(CPU_SERVER)]
    assert 'runpy.run_module("sglang.launch_server", run_name="__main__"' in CPU_SERVER.read_text()
    assert "prepare_server_args(sys.argv[1:])" in inspect.getsource(sglang.launch_server)


def test_launched_servers_get_arguments_sglang_parses_into_the_intended_server_args(spec, tmp_path):
    script = tmp_path / "write_down.py"
    script.write_text(WRITE_DOWN)
    port = free_port()
    launch = LaunchSettings(
        command=[sys.executable, str(script), str(tmp_path)],
        num_servers=2,
        port=port,
        gpu_ids=[4, 5, 6, 7],
        mem_fraction_static=0.55,
        args=["--random-seed", "7"],
        start_timeout_s=60,
    )
    pool = SGLangRolloutPool(servers={"tp_size": 2}, launch=launch)
    try:
        with pytest.raises(RuntimeError, match="exited with code 3 while starting"):
            pool.start(spec)
    finally:
        pool.close()
    for index, gpus in enumerate(("4,5", "6,7")):
        launched = json.loads((tmp_path / f"server-{port + index}.json").read_text())
        assert launched["CUDA_VISIBLE_DEVICES"] == gpus
        args = prepare_server_args(launched["argv"])
        assert isinstance(args, ServerArgs)
        assert (args.model_path, args.host, args.port) == (str(spec.model_dir), "127.0.0.1", port + index)
        assert (args.tp_size, args.mem_fraction_static, args.dtype) == (2, 0.55, "bfloat16")
        assert args.enable_deterministic_inference is True and args.random_seed == 7


@pytest.mark.parametrize("deterministic", [True, False])
def test_deterministic_inference_reaches_server_args_and_server_info_where_the_pool_reads_it(deterministic):
    """The pool's ``deterministic_inference`` sets SGLang's ``enable_deterministic_inference``, and an attached server's
    ``/server_info`` (``build_server_info``, as http_server.py's ``server_info`` serves it) says so in the key the
    pool reads: no warning with the flag, a warning naming the server without it."""
    command = server_command(LaunchSettings(command=["sglang"]), "/models/policy", 30000, 1, deterministic)
    args = prepare_server_args(command[1:])
    assert args.enable_deterministic_inference is deterministic
    info = msgspec_to_builtins(build_server_info(args, {}))

    class Client:  # serves SGLang's own /server_info body to the pool
        def get(self, url, path):
            return path

        def run(self, path):
            assert path == "/server_info"
            return json.loads(json.dumps(info, default=str))

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warn_unseeded(Client(), [Server(url="http://sglang:30000")])
    named = [w for w in caught if "do not report --enable-deterministic-inference" in str(w.message)]
    assert len(named) == (0 if deterministic else 1)


def test_the_lora_flags_pass_sglangs_own_lora_check():
    """``sync.lora=adapter``: the launched server's LoRA flags parse and pass ``check_lora_server_args`` (which
    refuses ``--enable-lora`` without a rank and target modules, and fewer loaded adapters than per batch)."""
    from sglang.srt.arg_groups.lora_hook import check_lora_server_args

    extra = lora_launch_args(8)
    command = server_command(LaunchSettings(command=["sglang"]), "/models/policy", 30000, 1, True, extra)
    args = prepare_server_args(command[1:])
    check_lora_server_args(args)
    assert args.enable_lora and args.max_lora_rank == 8 and args.lora_target_modules == ["all"]
    assert args.max_loaded_loras >= 2 > args.max_loras_per_batch  # the next version loads before the last unloads
    with pytest.raises((AssertionError, ValueError)):  # the stand-in refuses the same
        check_lora_server_args(prepare_server_args(["--model-path", "m", "--enable-lora"]))


def test_the_pools_dtypes_and_flags_are_sglangs():
    import argparse

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    options = {option: action for action in parser._actions for option in action.option_strings}
    assert set(SERVER_DTYPES) <= set(options["--dtype"].choices)
    flags = ("--model-path", "--host", "--port", "--tp-size", "--mem-fraction-static", "--dtype")
    for flag in (*flags, "--enable-deterministic-inference"):
        assert flag in options, flag  # server_command's flags
    with pytest.raises(SystemExit):  # what the stand-in copies: an unknown flag stops the server
        prepare_server_args(["--model-path", "m", "--no-such-flag"])


def test_the_router_command_is_parsed_by_sglang_routers_own_parser():
    urls = ["http://127.0.0.1:30000", "http://127.0.0.1:30001"]
    command = router_command(urls, "127.0.0.1", 30100, ["--policy", "round_robin"])
    assert command[:3] == [sys.executable, "-m", "sglang_router.launch_router"]
    args = parse_router_args(command[3:])
    assert (args.worker_urls, args.host, args.port, args.policy) == (urls, "127.0.0.1", 30100, "round_robin")
