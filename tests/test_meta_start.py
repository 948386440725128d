"A run built on the meta device starts from the same weights on 1, 2 and 4 FSDP2 ranks (gloo), bit for bit."
import pytest
import torch
from gloo_ranks import run_ranks


def _initial_weights(rank, world, out, tie):
    "Build the run model of a small config under FSDP2 on `world` ranks; rank 0 saves the gathered full weights."
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from gradient_garden.config import GlobalConfig, RuntimeConfig
    from gradient_garden.parallel.distributed import DistEnv
    from gradient_garden.train.run import build_run_model
    cfg = GlobalConfig()
    # 1.28M-element embedding: two init blocks
    cfg.model.dim, cfg.model.n_layers, cfg.model.vocab_size, cfg.model.tie_embeddings = 256, 2, 5000, tie
    cfg.runtime = RuntimeConfig(device="cpu", fsdp=True)
    model = build_run_model(cfg, DistEnv(rank, rank, world, torch.device("cpu"), "gloo", world))
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0: torch.save({k: v.clone() for k, v in full.items()}, out)


@pytest.mark.slow
@pytest.mark.parametrize("tie", [False, True])
def test_initial_weights_equal_across_world_sizes(tmp_path, tie):
    weights = {}
    for world in (1, 2, 4):
        run_ranks(_initial_weights, world, tmp_path/f"init{world}", str(tmp_path/f"w{world}.pt"), tie)
        weights[world] = torch.load(tmp_path/f"w{world}.pt", weights_only=True)
    assert set(weights[1]) == set(weights[2]) == set(weights[4])
    for k, v in weights[1].items():
        assert torch.equal(v, weights[2][k]) and torch.equal(v, weights[4][k]), k
    emb = weights[1]["tok_embeddings.weight"]
    assert abs(float(emb.std()) - 0.02) < 1e-3 and torch.equal(weights[1]["norm.weight"], torch.ones(256))
