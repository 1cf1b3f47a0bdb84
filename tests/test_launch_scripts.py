"""The launch scripts (scripts/launch/): their commands for an 8 x H200 host, and the same scripts
run at tiny scale on CPU so they cannot rot: the README's CPU launch command (the colocated script
with its CPU defaults) answers the README's request, a PD decode instance (fake transfer backend)
serves requests; the router pairs prefill and decode; --plan prints the plan."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from serving import QUIET, settle, stop_soon
from sglang_hisparse.serving.launcher import MODELS_DIR, free_port, post_json, run_server, server_env, wait_for_idle_report

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts" / "launch"
TINY = {"MODEL": str(MODELS_DIR / "tiny-dsa-cpu"), "DEVICE": "cpu", "TP": "1", "DP": "1", "DP_ATTENTION": "0",
        "HOST": "127.0.0.1", "MEM_FRACTION_STATIC": "0.5", "DEVICE_BUFFER_SIZE": "128", "HOST_TO_DEVICE_RATIO": "2",
        "EXTRA_ARGS": "--load-format dummy --skip-tokenizer-init --max-total-tokens 16384 --random-seed 0 "
                      "--disable-overlap-schedule " + " ".join(QUIET)}


def dry_run(script: str, **env: str) -> list[str]:
    result = subprocess.run(["bash", str(SCRIPTS / script), "--dry-run"], capture_output=True, text=True,
                            env={**os.environ, "PYTHON": sys.executable, **env}, timeout=60)
    assert result.returncode == 0, result.stderr
    return shlex.split(result.stdout)


def flag(cmd: list[str], name: str) -> str:
    return cmd[cmd.index(name) + 1]


def test_defaults_are_an_8xh200_deployment_with_hisparse_on_the_decode_side():
    colocated, prefill, decode = dry_run("colocated.sh"), dry_run("pd_prefill.sh"), dry_run("pd_decode.sh")
    for cmd in (colocated, prefill, decode):
        assert cmd[1:3] == ["-m", "sglang.launch_server"] and flag(cmd, "--model-path") == "deepseek-ai/DeepSeek-V3.2"
        assert flag(cmd, "--tp-size") == "8" and flag(cmd, "--dp-size") == "8" and "--enable-dp-attention" in cmd
        assert flag(cmd, "--dsa-decode-backend") == "flashmla_sparse" and flag(cmd, "--kv-cache-dtype") == "bfloat16"
    assert json.loads(flag(colocated, "--hisparse-config")) == {"device_buffer_size": 4096, "host_to_device_ratio": 5}
    assert "--enable-hisparse" not in prefill and flag(prefill, "--disaggregation-mode") == "prefill"
    assert flag(prefill, "--disaggregation-bootstrap-port") == "8998"
    assert flag(decode, "--disaggregation-mode") == "decode" and "--disable-radix-cache" in decode
    assert json.loads(flag(decode, "--hisparse-config")) == {"device_buffer_size": 4096, "host_to_device_ratio": 10}
    router = dry_run("router.sh")
    assert router[1:4] == ["-m", "sglang_router.launch_router", "--pd-disaggregation"]  # SGLang's own router
    assert router[router.index("--prefill") + 1:router.index("--prefill") + 3] == ["http://127.0.0.1:30000", "8998"]
    assert flag(router, "--decode") == "http://127.0.0.1:30001"
    assert dry_run("router.sh", ROUTER="hisparse")[1:3] == ["-m", "sglang_hisparse.serving.pd_router"]
    assert "--mini-lb" in dry_run("router.sh", ROUTER="mini")


def test_every_script_listens_on_the_loopback_address_unless_told_otherwise():
    """SGLang's servers and the routers take requests without authentication: nothing listens on a
    public address by default."""
    for script in ("colocated.sh", "pd_prefill.sh", "pd_decode.sh", "router.sh"):
        assert flag(dry_run(script), "--host") == "127.0.0.1", script
        assert flag(dry_run(script, HOST="10.0.0.5"), "--host") == "10.0.0.5", script
    one_machine = subprocess.run(["bash", str(SCRIPTS / "pd_one_machine.sh"), "--dry-run"], capture_output=True,
                                 text=True, env={**os.environ, "PYTHON": sys.executable, "HOST": "0.0.0.0"}, timeout=60)
    assert one_machine.returncode == 0, one_machine.stderr
    commands = [shlex.split(line) for line in one_machine.stdout.splitlines()]
    assert len(commands) == 3 and all(flag(cmd, "--host") == "127.0.0.1" for cmd in commands)
    prefill, decode, router = commands
    assert flag(prefill, "--disaggregation-transfer-backend") == flag(decode, "--disaggregation-transfer-backend") \
        == "mooncake_tcp"
    assert "--enable-hisparse" in decode and "--enable-hisparse" not in prefill
    assert router[1:3] == ["-m", "sglang_router.launch_router"]


def test_every_value_is_a_variable():
    cmd = dry_run("pd_decode.sh", KV_CACHE_DTYPE="fp8_e4m3", DP_ATTENTION="0", TP="4", DP="1", BASE_GPU_ID="4",
                  IB_DEVICE="mlx5_0", TRANSFER_BACKEND="mooncake_tcp", DEVICE_BUFFER_SIZE="6144",
                  HISPARSE_EXTRA='"stats_log_interval": 100', CONTEXT_LENGTH="131072", EXTRA_ARGS="--max-running-requests 64")
    assert flag(cmd, "--dsa-prefill-backend") == "flashmla_kv" and "--enable-dp-attention" not in cmd
    assert flag(cmd, "--tp-size") == "4" and flag(cmd, "--base-gpu-id") == "4" and flag(cmd, "--context-length") == "131072"
    assert flag(cmd, "--disaggregation-ib-device") == "mlx5_0" and flag(cmd, "--disaggregation-transfer-backend") == "mooncake_tcp"
    assert json.loads(flag(cmd, "--hisparse-config")) == {"device_buffer_size": 6144, "host_to_device_ratio": 10,
                                                          "stats_log_interval": 100}
    assert cmd[-2:] == ["--max-running-requests", "64"]


def test_unknown_options_are_refused():
    result = subprocess.run(["bash", str(SCRIPTS / "colocated.sh"), "--dryrun"], capture_output=True, text=True)
    assert result.returncode == 2 and "unknown option --dryrun (allowed: --dry-run, --plan, --help)" in result.stderr


def test_the_plan_option_prints_the_capacity_of_these_values():
    result = subprocess.run(["bash", str(SCRIPTS / "colocated.sh"), "--plan"], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PYTHON": sys.executable, "MODEL": str(MODELS_DIR / "tiny-dsa"),
                                 "TP": "1", "DP": "1", "DP_ATTENTION": "0", "HOST_MEM_GIB": "4000"})
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("sglang-hisparse capacity: device rows ")
    refused = subprocess.run(["bash", str(SCRIPTS / "colocated.sh"), "--plan"], capture_output=True, text=True,
                             timeout=120, env={**os.environ, "PYTHON": sys.executable, "MODEL": str(MODELS_DIR / "tiny-dsa"),
                                               "TP": "1", "DP": "1", "DP_ATTENTION": "0", "HOST_MEM_GIB": "10"})
    assert refused.returncode == 2 and "plan refused: pinned host memory" in refused.stderr


def _run_script(script: str, tmp_path: Path, **extra: str):
    port = free_port()
    env = server_env(cpu=True, extra={**TINY, "PORT": str(port), "PYTHON": sys.executable, **extra})
    server = run_server(["bash", str(SCRIPTS / script)], port=port, env=env, log_dir=tmp_path, name=script,
                        ready_timeout=300)
    settle(server)
    return server


def readme_cpu_launch() -> tuple[str, dict]:
    """The README's CPU launch command (its colocated.sh line) and the body of its curl request."""
    section = (ROOT / "README.md").read_text().split("On a CPU-only machine", 1)[1]
    block = section.split("```bash", 1)[1].split("```", 1)[0]
    launch = next(line for line in block.splitlines() if "scripts/launch/colocated.sh" in line).split("#")[0].strip()
    body = json.loads(re.search(r"-d '(\{.*\})'", block).group(1))
    return launch, body


def _run_readme_launch(tmp_path: Path):
    """The README's command as a user types it in the checkout, with the project's Python first on
    PATH (an activated venv) and a free PORT (a variable the script documents)."""
    launch, _ = readme_cpu_launch()
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SGLANG_", "PYTHONPATH"))}
    env.update(PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}", PORT=str(port))
    server = run_server(["bash", "-c", f"cd {shlex.quote(str(ROOT))} && {launch}"], port=port, env=env,
                        log_dir=tmp_path, name="readme_cpu_launch", ready_timeout=300)
    settle(server)
    return server


def test_the_readme_cpu_launch_is_the_colocated_script_on_the_shipped_model():
    launch, body = readme_cpu_launch()
    assert launch == "DEVICE=cpu bash scripts/launch/colocated.sh"
    assert body["input_ids"] and body["sampling_params"]["max_new_tokens"] == 8
    command = dry_run("colocated.sh", DEVICE="cpu")
    assert command[command.index("--model-path") + 1] == str(MODELS_DIR / "tiny-dsa-cpu")
    assert "--enable-hisparse" in command and "--load-format" in command


@pytest.fixture(scope="module")
def script_servers(tmp_path_factory):
    """The README's CPU launch (colocated.sh) and pd_decode.sh (fake transfer backend) at tiny
    scale, started side by side."""
    logs = tmp_path_factory.mktemp("launch_scripts")
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {"colocated": pool.submit(_run_readme_launch, logs),
                   "pd_decode": pool.submit(_run_script, "pd_decode.sh", logs, TRANSFER_BACKEND="fake")}
    started = {name: f.result() for name, f in futures.items() if f.exception() is None}
    try:
        for f in futures.values():
            if f.exception() is not None:
                raise f.exception()
        yield started
    finally:
        stop_soon(started.values())


@pytest.mark.slow
def test_the_readme_cpu_launch_answers_the_readme_request(script_servers):
    server = script_servers["colocated"]
    before = settle(server)
    _, body = readme_cpu_launch()
    answer = post_json(f"{server.url}/generate", body, 300)
    assert 1 <= len(answer["output_ids"]) <= 8 and answer["meta_info"]["finish_reason"]["type"] in ("length", "stop")
    out = server.generate([[5 + i % 1000 for i in range(600)]], 8)
    assert len(out[0]["output_ids"]) == 8
    report = wait_for_idle_report(server, after=before)
    # the script's config leaves residency on (the default) and the pool has room: the request stayed
    # resident, reading its own rows (nothing copied from host)
    assert not report["leak"] and report["admitted_resident"] > 0 and report["misses"] == 0, report


@pytest.mark.slow
def test_the_pd_decode_script_serves_at_tiny_scale(script_servers):
    server = script_servers["pd_decode"]
    before = settle(server)
    body = {"input_ids": [[5 + i % 1000 for i in range(400)]], "bootstrap_host": ["2.2.2.2"], "bootstrap_room": [7],
            "sampling_params": {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}}
    assert len(post_json(f"{server.url}/generate", body, 300)[0]["output_ids"]) == 8
    assert not wait_for_idle_report(server, after=before)["leak"]


class _Recorder(BaseHTTPRequestHandler):
    """An instance stand-in: records what it received, answers with its canned body."""

    protocol_version = "HTTP/1.1"

    def do_GET(self):  # noqa: N802
        self._answer(200, b"")

    def do_POST(self):  # noqa: N802
        self.server.bodies.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
        self._answer(200, self.server.answer)

    def _answer(self, status, data):
        self.send_response(status)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


def _stand_in(answer: bytes) -> ThreadingHTTPServer:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    server.bodies, server.answer = [], answer
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def test_the_router_script_pairs_each_request_on_both_instances(tmp_path):
    prefill, decode = _stand_in(b"{}"), _stand_in(b'[{"output_ids": [1, 2]}, {"output_ids": [3]}]')
    port = free_port()
    env = {**os.environ, "PYTHON": sys.executable, "PORT": str(port), "HOST": "127.0.0.1", "BOOTSTRAP_PORT": "9123",
           "PREFILL_URL": f"http://127.0.0.1:{prefill.server_port}", "DECODE_URL": f"http://127.0.0.1:{decode.server_port}"}
    router = run_server(["bash", str(SCRIPTS / "router.sh")], port=port, env=env, log_dir=tmp_path, name="router",
                        ready_timeout=60)
    try:
        out = post_json(f"{router.url}/generate", {"input_ids": [[1, 2], [3]], "sampling_params": {"max_new_tokens": 2}}, 60)
        assert out == [{"output_ids": [1, 2]}, {"output_ids": [3]}]
        # the router answers from decode, then joins its prefill thread: that post may land just after
        deadline = time.monotonic() + 10
        while not prefill.bodies and time.monotonic() < deadline:
            time.sleep(0.01)
        (sent_prefill,), (sent_decode,) = prefill.bodies, decode.bodies
        assert sent_prefill == sent_decode
        assert sent_decode["bootstrap_host"] == ["127.0.0.1"] * 2 and sent_decode["bootstrap_port"] == [9123] * 2
        rooms = sent_decode["bootstrap_room"]
        assert len(rooms) == 2 and rooms[0] != rooms[1] and all(0 <= r < 2**63 for r in rooms)
    finally:
        router.stop()
        prefill.shutdown()
        decode.shutdown()


@pytest.mark.slow
def test_the_one_machine_pd_pair_moves_real_kv_at_tiny_scale(tmp_path):
    """pd_one_machine.sh on CPU with the tiny model: a prefill instance, a HiSparse decode instance
    and SGLang's own router (sglang-router), the KV moving over mooncake's TCP transport; a request
    through the router completes and the decode instance's pools are back at their initial counts.
    (Outputs against a colocated server: tests/test_e2e_cpu_pd_mooncake.py.)"""
    pytest.importorskip("mooncake.engine", reason="needs mooncake-transfer-engine-non-cuda", exc_type=ImportError)
    pytest.importorskip("sglang_router", reason="needs sglang-router")
    ports = {name: str(free_port()) for name in ("PORT", "PREFILL_PORT", "DECODE_PORT", "BOOTSTRAP_PORT")}
    env = server_env(cpu=False, extra={**TINY, **ports, "PYTHON": sys.executable, "PREFILL_MEM_FRACTION": "0.5",
                                       "DECODE_MEM_FRACTION": "0.5"})  # the script sets the CPU engine up itself
    pair = run_server(["bash", str(SCRIPTS / "pd_one_machine.sh")], port=int(ports["PORT"]), env=env,
                      log_dir=tmp_path, name="pd_one_machine", ready_timeout=400)
    try:
        deadline = time.time() + 120  # the script prints this once the router's workers are registered
        while "(send requests here)" not in pair.log() and time.time() < deadline:
            time.sleep(1)
        out = post_json(f"{pair.url}/generate", {"input_ids": [5 + i % 1000 for i in range(600)],
                                                 "sampling_params": {"max_new_tokens": 8, "temperature": 0.0,
                                                                     "ignore_eos": True}}, 300)
        assert len(out["output_ids"]) == 8
        report = wait_for_idle_report(pair)
        assert not report["leak"] and report["admitted_resident"] > 0, report
        log = pair.log()  # SGLang rewrites mooncake_tcp to mooncake with MC_FORCE_TCP=1; mooncake says so itself
        assert log.count("disaggregation_transfer_backend='mooncake'") == 2, "both instances on mooncake"
        assert log.count("MC_FORCE_TCP is set, using TCP transport only") >= 2, "both engines on TCP"
    finally:
        pair.stop()


def test_a_server_whose_port_was_taken_is_stopped_and_started_again_on_another(tmp_path, monkeypatch):
    """SGLang's HTTP server that loses its port between ``free_port`` and its bind logs uvicorn's
    "address already in use" and stays up without serving (a CI run waited 600 s for it):
    ``run_server`` stops it at once with ``PortTaken``, ``start_server`` tries another port."""
    from sglang_hisparse.serving import launcher

    stays_up = ("import time; print('ERROR:    [Errno 98] error while attempting to bind on address "
                "(127.0.0.1, 1): address already in use', flush=True); time.sleep(120)")
    t0 = time.time()
    with pytest.raises(launcher.PortTaken, match="taken"):
        launcher.run_server([sys.executable, "-c", stays_up], port=launcher.free_port(), env=dict(os.environ),
                            log_dir=tmp_path, name="taken", ready_timeout=60)
    assert time.time() - t0 < 30

    ports: list[int] = []

    def taken_twice(args, *, port, **kwargs):
        ports.append(port)
        assert args[args.index("--port") + 1] == str(port)
        if len(ports) < 3:
            raise launcher.PortTaken("taken")
        return "server"

    monkeypatch.setattr(launcher, "run_server", taken_twice)
    assert launcher.start_server(log_dir=tmp_path, cpu=True) == "server" and len(ports) == 3

    def always_taken(args, *, port, **kwargs):
        ports.append(port)
        raise launcher.PortTaken("taken")

    ports.clear()
    monkeypatch.setattr(launcher, "run_server", always_taken)
    with pytest.raises(launcher.PortTaken):
        launcher.start_server(log_dir=tmp_path, cpu=True)
    assert len(ports) == launcher.PORT_TRIES
