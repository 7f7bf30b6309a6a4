"""Which decoder families split into pipeline stages: for each family of the family sweep
(bench/family_sweep.py's list, transformers' own; remote-code fixtures aside), a tiny
random model (hyper_parallel/testing/tiny_families.py), then

- ``check_stage_handoff`` on its weights and on the meta device (as derive and the
  sharded load run it): pass, or the refusal;
- for a family that passes: the model pruned into two stages (prune_to_stage, each on its
  own copy) run in turn on the same tokens, against the whole model's logits (eval mode:
  a router's training-time noise, PhiMoE's, draws other numbers per call).

A family that passes the check but whose stages differ is the check's blind spot
(verify's pipeline run is the second line); the script prints them and exits 1.

    python bench/pipeline_families.py [--json PATH] [FAMILY ...]
"""

import argparse
import copy
import json
import logging
import sys
import time
import warnings

import torch
import transformers
from accelerate import init_empty_weights

from hyper_parallel.config.pipeline import PipelineSettings, stage_split
from hyper_parallel.distributed.pipeline import (
    PipelineSplitError,
    StageModule,
    check_stage_handoff,
    decoder_layer_weights,
    prune_to_stage,
)
from hyper_parallel.testing.tiny_families import is_remote, tiny_config

from family_sweep import enumerate_families  # beside this script

STAGE_TOLERANCE = 1e-4  # max abs difference of the logits (float32, the same ops in the same order)


def verdict(check, model) -> str:
    """'ok' or the refusal's text."""
    try:
        check(model)
        return "ok"
    except PipelineSplitError as exc:
        return str(exc)


def stages_agree(whole) -> tuple[bool, str]:
    """Two stages run in turn against the whole model: (agree, what was seen)."""
    weights = decoder_layer_weights(whole)
    if len(weights) < 2:
        return True, "one decoder layer: nothing to split"
    boundaries = stage_split(PipelineSettings(), 2, weights)
    parts = []
    for index in range(2):
        part = copy.deepcopy(whole)
        prune_to_stage(part, boundaries, (index,))
        parts.append(StageModule(part, index))
    vocab = whole.get_input_embeddings().weight.shape[0]
    ids = torch.randint(3, min(vocab, 200), (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = whole(input_ids=ids).logits
        got = parts[1](parts[0](ids))
    if got.shape != want.shape:
        return False, f"logits of shape {tuple(got.shape)}, the whole model's {tuple(want.shape)}"
    err = (got - want).abs().max().item()
    return err <= STAGE_TOLERANCE, f"max abs logit difference {err:.2g}"


def run_family(family: str) -> dict:
    config = tiny_config(family)
    torch.manual_seed(0)
    whole = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager",
                                                          dtype=torch.float32).eval()
    with init_empty_weights(include_buffers=False):
        meta = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager",
                                                             dtype=torch.float32)
    row = {"family": family, "check": verdict(check_stage_handoff, whole),
           "check_on_meta": verdict(check_stage_handoff, meta)}
    if row["check"] == "ok":
        row["stages_agree"], row["stages"] = stages_agree(whole)
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("families", nargs="*", help="family names (default: every family of the sweep)")
    parser.add_argument("--json", metavar="PATH", help="write the rows and the counts here")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    transformers.logging.set_verbosity_error()
    kept, _ = enumerate_families()
    families = [f for f in kept if not is_remote(f) and (not args.families or f in args.families)]
    rows, start = [], time.perf_counter()
    for number, family in enumerate(families, 1):
        try:
            row = run_family(family)
        except Exception as exc:  # the family's own code failed to build: a row, not a stop
            row = {"family": family, "check": f"not built: {type(exc).__name__}: {exc}"[:300],
                   "check_on_meta": "-"}
        rows.append(row)
        shown = row.get("stages", row["check"][:150])
        print(f"[{number}/{len(families)}] {family}: check {'ok' if row['check'] == 'ok' else 'refused'}, "
              f"meta {'ok' if row['check_on_meta'] == 'ok' else 'refused'}; {shown}", flush=True)
    passing = [r for r in rows if r["check"] == "ok"]
    blind = [r["family"] for r in passing if not r["stages_agree"]]
    meta_differs = [r["family"] for r in rows if (r["check"] == "ok") != (r["check_on_meta"] == "ok")]
    counts = {"families": len(rows), "pass_check": len(passing), "refused": len(rows) - len(passing),
              "pass_check_but_stages_differ": blind, "meta_verdict_differs": meta_differs,
              "seconds": round(time.perf_counter() - start, 1)}
    print(json.dumps(counts))
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"counts": counts, "rows": rows}, out, indent=1)
    return 1 if blind else 0


if __name__ == "__main__":
    sys.exit(main())
