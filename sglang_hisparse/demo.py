"""Demo: load SGLang's plugins as a server process does and show what sglang-hisparse changed."""

from __future__ import annotations

import json
import sys


def main() -> int:
    from sglang.srt.plugins import load_plugins
    from sglang.srt.plugins.hook_registry import HookRegistry

    from sglang_hisparse.config import parse_hisparse_config

    load_plugins()
    raw = '{"device_buffer_size": 128, "host_to_device_ratio": 4}'
    config = parse_hisparse_config(raw, model_index_topk=64)
    print(f"--hisparse-config {raw} with the model's index_topk=64 ->")
    print("  " + json.dumps(config.to_json_dict()))
    print("hooks in force:")
    for target, hooks in sorted(HookRegistry._hooks.items()):
        kinds = ", ".join(kind.value for kind, _, _ in hooks)
        applied = "applied" if target in HookRegistry._patched else "NOT APPLIED"
        print(f"  {kinds:8s} {target} ({applied})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
