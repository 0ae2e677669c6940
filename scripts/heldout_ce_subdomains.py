"""Held-out cross-entropy of a saved reference model per sub-domain (for the fine-grained model's card).

Usage::

    python scripts/heldout_ce_subdomains.py src/moeplace/data/reference-fg --config fine-grained \
        --json src/moeplace/data/reference-fg/heldout_ce_subdomains.json
"""

from __future__ import annotations

import argparse
import json
import sys

from moeplace.io import atomic_write_json
from moeplace.models.reference import preset
from moeplace.models.train import heldout_ce_by_subdomain


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", help="saved model folder")
    ap.add_argument("--config", default="fine-grained", help="the config the model was trained with")
    ap.add_argument("--json", help="write the result here")
    args = ap.parse_args(argv)
    try:
        r = {"model": args.model, "config": args.config, **heldout_ce_by_subdomain(args.model, preset(args.config))}
        if args.json:
            atomic_write_json(r, args.json)
    except (OSError, ValueError) as e:  # load_reference and preset name the folder / config
        print(f"heldout_ce_subdomains: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(r, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
