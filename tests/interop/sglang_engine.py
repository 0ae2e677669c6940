"""Run inside the SGLang virtualenv (scripts/interop_venvs.sh), never with moeplace's own venv: SGLang's own
``compute_initial_expert_location_metadata`` applied to a moeplace export. Called by tests/test_interop_engines.py.

  init MODEL_DIR EXPORT.json EP_SIZE REDUNDANT   loads EXPORT.json as ``--init-expert-location`` on every EP rank
                                                 of the model in MODEL_DIR (a config.json) and prints, as JSON,
                                                 the layer count SGLang expects and the maps it built per rank
"""

from __future__ import annotations

import json
import sys


def init(model_dir: str, export: str, ep_size: int, redundant: int) -> dict:
    import sglang
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.eplb.expert_location import ModelConfigForExpertLocation, compute_initial_expert_location_metadata
    from sglang.srt.runtime_context import get_context

    ranks = []
    with get_context().override_server_args(model_path=model_dir, tp_size=ep_size, ep_size=ep_size,
                                            ep_num_redundant_experts=redundant, init_expert_location=export,
                                            device="cpu", ep_dispatch_algorithm="static"):
        mc = ModelConfig(model_path=model_dir)
        want = ModelConfigForExpertLocation.from_model_config(mc)
        for rank in range(ep_size):
            md = compute_initial_expert_location_metadata(mc, moe_ep_rank=rank)
            ranks.append({"physical_to_logical_map": md.physical_to_logical_map.tolist(),
                          "logical_to_all_physical_map": md.logical_to_all_physical_map.tolist(),
                          "num_valid": md.logical_to_all_physical_map_num_valid.tolist(),
                          "dispatch": md.logical_to_rank_dispatch_physical_map.tolist()})
    return {"sglang": sglang.__version__, "num_layers": want.num_layers,
            "num_logical_experts": want.num_logical_experts, "ranks": ranks}


if __name__ == "__main__":
    print(json.dumps(init(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))))
