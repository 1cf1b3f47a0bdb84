"""DeepSeek-V4 on a PD decode instance with a real KV transfer, on one GPU: ours against SGLang.

Runs on the GPU machine (scripts/gpu/run.sh job ``v4pd``; carry .site/site-v4.tar.xz,
.site/v4.tar.xz, .site/pd.tar.xz and the wheel). Every server starts at once, side by side:

* ``colocated_none``: tiny-dsv4 without HiSparse, not disaggregated (the baseline);
* ``prefill``: a PD prefill instance without HiSparse (SGLang's V4 pool; Mooncake over TCP on
  127.0.0.1, sglang_hisparse_testkit.pd);
* one PD decode instance per ``--decodes`` entry (``ours``, ``ours_resident`` = ours with
  residency on, ``ours@B``, ``upstream``, ``none``),
  each behind its own router (sglang_hisparse.serving.pd_router), all served by the one prefill.

Phase 1 (exactness): ``--lengths`` prompts, one at a time (batch size 1 everywhere, so no
batch-shape numerics), through the baseline and every pair; greedy outputs compared token for
token with the baseline (``first_diff``: None = identical). On a HiSparse decode instance the C4
entries arrive in its host pool (SGLang's direct-to-host path) and decode reads them through the
hot buffer, so a wrong row shows here.

Phase 2 (lifecycle): ``--concurrent`` prompts at once through every pair, ``--abort`` of them
aborted on both instances once decoding; then ours' idle line must show every pool back
(``leak=no``). Outputs of the requests not aborted are compared with phase 1's baseline where the
prompt is the same (they run in other batches: recorded, not required).

    python scripts/gpu/v4_pd.py --decodes ours,ours@4096,upstream --out $OUT/v4pd.json

The JSON is written after each phase, so a call cut short still brings back what ran.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import v4_probe  # noqa: E402  (V4 server environment, prompts, comparisons, idle-line parsing)

from sglang_hisparse.serving.launcher import free_port, start_server  # noqa: E402
from sglang_hisparse_testkit.pd import PD_ENV, TRANSFER_BACKEND, RoutedPair, decode_args, prefill_args  # noqa: E402

LOG_DIR = Path(os.environ.get("E2E_LOG_DIR", "/tmp/e2e_logs")) / "v4pd"
DECODE_IMPLS = ("none", "upstream", "ours", "ours_resident")


def parse_decodes(text: str) -> list[tuple[str, int | None]]:
    """``impl[@B],...`` -> [(impl, B or None)]; ValueError naming the allowed values."""
    out = []
    for spec in text.split(","):
        impl, _, buffer = spec.partition("@")
        if impl not in DECODE_IMPLS or (buffer and not buffer.isdigit()):
            raise ValueError(f"--decodes: {spec!r} is not impl[@B] with impl one of {', '.join(DECODE_IMPLS)}")
        out.append((impl, int(buffer) if buffer else None))
    return out


def decode_name(impl: str, buffer: int | None) -> str:
    return f"decode_{impl}" + (f"_B{buffer}" if buffer else "")


def hisparse_config(impl: str, buffer: int | None, base: str) -> str | None:
    """None for none; ``base`` with B for ``@B``; ``ours_resident``: ours with ``"residency": true``
    (V4's default is off: every transferred request in a hot buffer, the slot-B path)."""
    if impl == "none":
        return None
    config = json.loads(base)
    if buffer is not None:
        config["device_buffer_size"] = buffer
    if impl == "ours_resident":
        config["residency"] = True
    return json.dumps(config)


def server_flags(args: argparse.Namespace) -> list[str]:
    """The flags of every server (v4_probe's, one-at-a-time form): decode graphs up to the
    concurrent phase's batch, step lines every step, room for tiny-dsv4's context in the SWA pool."""
    return ["--grammar-backend", "none", "--max-running-requests", str(args.concurrent + 1),
            "--mem-fraction-static", str(args.mem_fraction), "--decode-log-interval", "1",
            "--swa-full-tokens-ratio", "0.2", "--cuda-graph-max-bs", str(max(8, args.concurrent)),
            "--cuda-graph-backend-prefill", "disabled"]


def server_specs(args: argparse.Namespace, bootstrap_port: int) -> dict[str, dict]:
    flags = server_flags(args)
    specs = {"colocated_none": dict(extra_args=flags, env=dict(v4_probe.ENV), hisparse_config=None),
             "prefill": dict(extra_args=flags + prefill_args(bootstrap_port), env={**v4_probe.ENV, **PD_ENV},
                             hisparse_config=None)}
    for impl, buffer in parse_decodes(args.decodes):
        env = {**v4_probe.ENV, **PD_ENV}
        if impl == "upstream":
            env["SGLANG_PLUGINS"] = "hisparse_dummy_init"  # SGLang's own HiSparse, our dummy weights only
        specs[decode_name(impl, buffer)] = dict(extra_args=flags + decode_args(), env=env,
                                                hisparse_config=hisparse_config(impl, buffer, args.hisparse_config))
    return specs


def start_all(args: argparse.Namespace, specs: dict[str, dict]) -> tuple[dict[str, Any], dict[str, str]]:
    """Start every server at once; (started servers, errors by name)."""
    started: dict[str, Any] = {}
    errors: dict[str, str] = {}

    def start(name: str, spec: dict) -> None:
        try:
            started[name] = start_server(model=args.model, log_dir=LOG_DIR, cpu=False, name=name,
                                         max_total_tokens=args.max_total_tokens, ready_timeout=args.ready_timeout,
                                         **spec)
        except Exception as e:  # noqa: BLE001 - a server that does not start is a result
            errors[name] = f"{type(e).__name__}: {e}"[-3000:]

    with ThreadPoolExecutor(max_workers=len(specs)) as pool:
        list(pool.map(lambda item: start(*item), specs.items()))
    return started, errors


def one_at_a_time(client: Any, inputs: list[list[int]], new_tokens: int) -> list[dict]:
    """Each prompt alone (batch 1): output ids, or the error."""
    rows = []
    for ids in inputs:
        try:
            out = client.generate(ids, new_tokens)
            rows.append({"output_ids": out.get("output_ids"), "finish_reason": out.get("meta_info", {}).get("finish_reason")})
        except Exception as e:  # noqa: BLE001 - recorded
            rows.append({"error": repr(e)[:800]})
    return rows


def concurrent_with_aborts(pair: RoutedPair, inputs: list[list[int]], new_tokens: int, aborted: list[int],
                           abort_after_s: float) -> list[dict]:
    """Every prompt at once, each in its own call; the ``aborted`` ones get 8x the tokens and are
    aborted on both instances ``abort_after_s`` seconds after the decode instance logs its first
    decode step of the phase."""
    rows: list[dict] = [{} for _ in inputs]
    rids = [f"v4pd-{i:02d}-{uuid.uuid4().hex[:8]}" for i in range(len(inputs))]

    def run(i: int) -> None:
        n = new_tokens * (8 if i in aborted else 1)
        try:
            out = pair.generate(inputs[i], n, rid=rids[i])
            rows[i] = {"output_ids": out.get("output_ids"), "max_new_tokens": n,
                       "finish_reason": out.get("meta_info", {}).get("finish_reason")}
        except Exception as e:  # noqa: BLE001 - an aborted request may end in an HTTP error
            rows[i] = {"error": repr(e)[:800], "max_new_tokens": n}

    decodes_before = pair.decode.log().count("Decode batch")
    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(inputs))]
    for t in threads:
        t.start()
    deadline = time.time() + 300
    while pair.decode.log().count("Decode batch") == decodes_before and time.time() < deadline:
        time.sleep(0.05)
    time.sleep(abort_after_s)
    for i in aborted:
        pair.abort(rids[i])
    for t in threads:
        t.join()
    return rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--decodes", default="ours,ours_resident,upstream",
                   help="decode instances: impl[@B],... (impl: none, upstream, ours, ours_resident)")
    p.add_argument("--model", default="tiny-dsv4")
    p.add_argument("--lengths", default="600,2500,4300,7000,9500,12000", help="phase 1 prompt lengths")
    p.add_argument("--new-tokens", type=int, default=40)
    p.add_argument("--concurrent", type=int, default=8, help="phase 2 prompts (0: no phase 2)")
    p.add_argument("--abort", type=int, default=2, help="phase 2 prompts aborted mid-decode")
    p.add_argument("--abort-after-s", type=float, default=1.0)
    p.add_argument("--hisparse-config", default='{"top_k": 512, "device_buffer_size": 1024, "host_to_device_ratio": 2}')
    p.add_argument("--max-total-tokens", type=int, default=131072)
    p.add_argument("--mem-fraction", type=float, default=0.6,
                   help="per server: SGLang's start-up check needs (1 - this) of the GPU free, five servers share it; "
                        "--max-total-tokens caps each pool")
    p.add_argument("--ready-timeout", type=float, default=420)
    p.add_argument("--seed", type=int, default=3)
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "/tmp/out"), "v4pd.json"))
    args = p.parse_args(argv)
    parse_decodes(args.decodes)
    if not 0 <= args.abort <= args.concurrent:
        p.error(f"--abort {args.abort}: must be between 0 and --concurrent ({args.concurrent})")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    vocab = v4_probe.model_config(args.model)["vocab_size"]
    lengths = [int(n) for n in args.lengths.split(",")]
    inputs = v4_probe.prompts(lengths, vocab, args.seed)
    result: dict = {"command": " ".join(["python", "scripts/gpu/v4_pd.py", *(argv or sys.argv[1:])]),
                    "model": args.model, "transfer_backend": TRANSFER_BACKEND, "lengths": lengths,
                    "new_tokens": args.new_tokens, "device": v4_probe.device_info(), "phase1": {}, "phase2": {}}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        out.write_text(json.dumps(result, indent=1))

    bootstrap_port = free_port()
    specs = server_specs(args, bootstrap_port)
    t0 = time.time()
    servers, errors = start_all(args, specs)
    result["start_s"], result["start_errors"] = round(time.time() - t0, 1), errors
    print(f"[v4pd] up in {result['start_s']} s: {sorted(servers)}; failed: {sorted(errors)}", flush=True)
    save()
    pairs = {name: RoutedPair(servers["prefill"], server, bootstrap_port)
             for name, server in servers.items() if name.startswith("decode_") and "prefill" in servers}
    try:
        clients: dict[str, Any] = dict(pairs)
        if "colocated_none" in servers:
            clients = {"colocated_none": servers["colocated_none"], **clients}
        reports_before = {name: len(v4_probe.idle_reports(pair.decode.log())) for name, pair in pairs.items()}
        phase1 = {}
        for name, client in clients.items():  # one after another: batch 1 on every server
            t = time.time()
            phase1[name] = {"requests": one_at_a_time(client, inputs, args.new_tokens), "wall_s": round(time.time() - t, 1)}
            print(f"[v4pd] phase 1 {name}: {phase1[name]['wall_s']} s", flush=True)
        result["phase1"] = {"results": phase1, "compare": v4_probe.compare(phase1, lengths)}
        save()
        if args.concurrent:
            concurrent_inputs = [inputs[i % len(inputs)] for i in range(args.concurrent)]
            aborted = v4_probe.abort_indices(args.concurrent, args.abort)
            phase2 = {}
            for name, pair in pairs.items():
                rows = concurrent_with_aborts(pair, concurrent_inputs, args.new_tokens, aborted, args.abort_after_s)
                report = v4_probe.wait_for_idle(pair.decode, reports_before[name], 120) \
                    if name.startswith("decode_ours") else None  # ours and ours_resident
                base = phase1.get("colocated_none", {}).get("requests", [])
                diffs = [None if i in aborted or not base else
                         v4_probe.first_diff(base[i % len(inputs)].get("output_ids"), rows[i].get("output_ids"))
                         for i in range(args.concurrent)]
                phase2[name] = {"requests": rows, "aborted": aborted, "first_diff_vs_phase1_baseline": diffs,
                                "idle_report": report, "pools_back_to_initial": v4_probe.pools_back(report)}
                print(f"[v4pd] phase 2 {name}: diffs {diffs} pools back {phase2[name]['pools_back_to_initial']}",
                      flush=True)
            result["phase2"] = phase2
            save()
    finally:
        for pair in pairs.values():
            pair.close()
        for name, server in servers.items():
            server.stop()
            log = (LOG_DIR / f"{name}.log")
            text = log.read_text(errors="replace") if log.exists() else ""
            result.setdefault("logs", {})[name] = {
                "idle_lines": [ln[:400] for ln in text.splitlines() if "sglang-hisparse idle" in ln][-20:],
                "error_lines": v4_probe.interesting_lines(text, v4_probe.ERROR_LINE, limit=30),
                "tail": [ln[:400] for ln in text.splitlines()[-30:]]}
        save()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
