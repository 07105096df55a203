"""Tensor-parallel sharding rules: the shards recombine to the unsharded layer (CPU, gloo)."""

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import save_file

from svdq_linear import SVDQW4A4Linear, nvfp4
from svdq_linear.parallel import COLUMN, ROW, ColumnParallelW4A4, RowParallelW4A4, load_shard, shard, shard_bounds


def _layer(k=96, n=40, r=8, bias=True):
    lin = torch.nn.Linear(k, n, bias=bias)
    return SVDQW4A4Linear.from_linear(lin, rank=r, act_max=torch.rand(k) * 8 + 0.5)


def _contract(m, x):
    return nvfp4.w4a4_linear(x, m.qweight, m.wscales, m.smooth, m.proj_down, m.proj_up, m.wcscale, m.bias,
                             torch.float64)


@pytest.mark.parametrize("world", [2, 3])
def test_column_shards_concatenate_to_the_layer(world):
    m, x = _layer(), torch.randn(7, 96) * 2
    parts = [shard(m, COLUMN, r, world) for r in range(world)]
    assert sum(p.out_features for p in parts) == 40 and all(p.in_features == 96 for p in parts)
    y = torch.cat([p(x) for p in parts], dim=-1)
    torch.testing.assert_close(y.double(), _contract(m, x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("world", [2, 3])
def test_row_shards_sum_to_the_layer(world):
    m, x = _layer(), torch.randn(7, 96) * 2
    parts = [shard(m, ROW, r, world) for r in range(world)]
    bounds = [shard_bounds(96, r, world, 16) for r in range(world)]
    assert [p.in_features for p in parts] == [hi - lo for lo, hi in bounds]
    assert parts[0].bias is not None and all(p.bias is None for p in parts[1:]), "the bias is added once"
    y = sum(p(x[:, lo:hi]).double() for p, (lo, hi) in zip(parts, bounds))
    torch.testing.assert_close(y, _contract(m, x), rtol=1e-5, atol=1e-5)


def test_row_boundaries_are_16_aligned_and_refused_otherwise():
    # 6 blocks of 16 over 4 ranks: 2, 2, 1, 1
    assert [shard_bounds(96, r, 4, 16) for r in range(4)] == [(0, 32), (32, 64), (64, 80), (80, 96)]
    with pytest.raises(ValueError, match="cannot shard 32"):
        shard_bounds(32, 0, 3, 16)
    with pytest.raises(ValueError, match="expected kind"):
        shard(_layer(), "diagonal", 0, 2)


def test_load_shard_reads_only_its_slice(tmp_path):
    m = _layer()
    save_file({f"blk.fc.{k}": v.contiguous() for k, v in m.state_dict().items()}, tmp_path / "w.safetensors")
    for kind in (COLUMN, ROW):
        for r in range(2):
            a, b = load_shard(tmp_path / "w.safetensors", "blk.fc", kind, r, 2), shard(m, kind, r, 2)
            assert a.state_dict().keys() == b.state_dict().keys()
            for key, t in a.state_dict().items():
                assert torch.equal(t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t,
                                   b.state_dict()[key].view(torch.uint8) if t.dtype == torch.float8_e4m3fn
                                   else b.state_dict()[key]), (kind, r, key)
    with pytest.raises(KeyError, match="missing tensors"):
        load_shard(tmp_path / "w.safetensors", "blk.other", COLUMN, 0, 2)


def _worker(rank, world, init, path, out):
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    torch.manual_seed(0)
    x = torch.randn(5, 96) * 2  # the same input on every rank
    lo, hi = shard_bounds(96, rank, world, 16)
    row = RowParallelW4A4(load_shard(path, "fc", ROW, rank, world))
    col = ColumnParallelW4A4(load_shard(path, "fc", COLUMN, rank, world), gather=True)
    y_row, y_col = row(x[:, lo:hi]), col(x)
    if rank == 0:
        torch.save({"row": y_row, "col": y_col, "x": x}, out)
    dist.destroy_process_group()


def test_gloo_row_and_column_parallel_match_the_layer(tmp_path):
    m = _layer()
    save_file({f"fc.{k}": v.contiguous() for k, v in m.state_dict().items()}, tmp_path / "w.safetensors")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    mp.spawn(_worker, args=(2, f"file://{tmp_path / 'rdv'}", str(tmp_path / "w.safetensors"),
                            str(tmp_path / "out.pt")), nprocs=2, join=True)
    got = torch.load(tmp_path / "out.pt")
    want = _contract(m, got["x"])
    torch.testing.assert_close(got["row"].double(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got["col"].double(), want, rtol=1e-5, atol=1e-5)


def _worker_bf16(rank, world, init, path, out):
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    torch.manual_seed(1)
    x = (torch.randn(5, 96) * 2).bfloat16()
    lo, hi = shard_bounds(96, rank, world, 16)
    row = RowParallelW4A4(load_shard(path, "fc", ROW, rank, world))
    col = ColumnParallelW4A4(load_shard(path, "fc", COLUMN, rank, world), gather=True)
    y_row, y_col = row(x[:, lo:hi]), col(x)
    y_col2 = col(x)  # the sizes are asked once
    if rank == 0:
        torch.save({"row": y_row, "col": y_col, "col2": y_col2, "x": x}, out)
    dist.destroy_process_group()


def test_gloo_bf16_row_sum_in_fp32_and_uneven_column_gather(tmp_path):
    """Three ranks, a bf16 layer: the row-parallel partials (each the local layer's bf16 output) are summed in fp32
    and rounded once, not added in bf16 rank by rank; the column shares of 40 outputs (14, 13, 13) gather on gloo,
    whose all_gather takes equal sizes only."""
    torch.manual_seed(0)
    m = _layer(bias=True).bfloat16()
    save_file({f"fc.{k}": v.contiguous() for k, v in m.state_dict().items()}, tmp_path / "w.safetensors")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    mp.spawn(_worker_bf16, args=(3, f"file://{tmp_path / 'rdv'}", str(tmp_path / "w.safetensors"),
                                 str(tmp_path / "out.pt")), nprocs=3, join=True)
    got = torch.load(tmp_path / "out.pt")
    x = got["x"]
    bounds = [shard_bounds(96, r, 3, 16) for r in range(3)]
    partials = [shard(m, ROW, r, 3)(x[:, lo:hi]) for r, (lo, hi) in enumerate(bounds)]
    assert all(p.dtype == torch.bfloat16 for p in partials)
    assert torch.equal(got["row"], sum(p.float() for p in partials).bfloat16())
    want = torch.cat([shard(m, COLUMN, r, 3)(x) for r in range(3)], dim=-1)
    assert got["col"].shape == (5, 40) and torch.equal(got["col"], want) and torch.equal(got["col2"], want)


def test_shards_keep_the_layers_settings_and_row_shards_run_exact():
    """A shard keeps the layer's own mode, backend preference and name; a row shard runs the exact mode (the fast
    mode's scales are maxima over all of K), and a layer set to the fast mode is refused for row sharding."""
    from svdq_linear.linear import name_layers

    m = _layer()
    model = torch.nn.ModuleDict({"fc": m})
    name_layers(model)
    m.set_mode("fast")
    m._backend_pref = "reference"
    col = shard(m, COLUMN, 1, 2)
    assert col.mode == "fast" and col._backend_pref == "reference" and col.layer_name == "fc[column 1/2]"
    with pytest.raises(ValueError, match="fast mode does not row-shard"):
        shard(m, ROW, 0, 2)
    for mode in (None, "auto", "exact"):
        m.set_mode(mode)
        row = shard(m, ROW, 1, 2)
        assert row.mode == "exact" and row.layer_name == "fc[row 1/2]"
