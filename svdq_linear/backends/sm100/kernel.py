"""The sm100 W4A4 kernel: persistent, warp-specialized, 2-CTA block-scaled NVFP4 GEMM with the
SVDQuant low-rank product issued into the same TMEM accumulator and a fused ``* wcscale + bias``
epilogue. See ``design.md`` beside this file.

Structure follows CUTLASS's ``dense_blockscaled_gemm_persistent.py`` (TMA atoms, SF SMEM->TMEM
copies, 2-CTA MMA, TMA-store epilogue) and FA4's skeleton (one method per warp role, explicit
pipeline states that live across persistent tiles). Configuration, stage counts, phases and the
low-rank schedule come from ``host.py``, ``layouts.py`` and ``pipeline_model.py``.

Warp roles (192 threads per CTA):

- warps 0-3: epilogue (TMEM -> registers, ``* wcscale + bias``, -> SMEM -> TMA store); warp 0
  allocates and frees TMEM;
- warp 4: MMA (leader CTA of the pair issues; both CTAs run the loop to keep state in step);
- warp 5: TMA loads (A/B/SFA/SFB per K tile, lora_act/proj_up chunks per tile).

Tensors (all K-major; shapes as the kernel sees them, ``L = 1`` batch mode appended):
``a [M, K] e2m1``, ``b [N, K] e2m1``, ``sfa``/``sfb`` scale-factor atom layout of ``[M|N, K/16]`` e4m3,
``a2 [M, R] bf16`` (lora_act), ``b2 [N_pad, R] bf16`` (proj_up / wcscale), ``c [M, N]`` bf16/fp16,
``wcscale [N_pad] f32``, ``bias [N_pad] f32`` (``N_pad`` = N rounded up to the MMA tile).
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils as utils
import cutlass.utils.blackwell_helpers as sm100_utils
import cutlass.utils.blockscaled_layout as blockscaled_utils
from cutlass.cute.nvgpu import cpasync, tcgen05
from cutlass.pipeline import pipeline_init_arrive, pipeline_init_wait
from cutlass.tensor_utils import LayoutEnum

from . import host, layouts
from .host import KernelConfig
from .pipeline_model import EPILOGUE_WARPS, lowrank_issue_ktile, lowrank_load_ktile, pipeline_specs


class Sm100W4A4Kernel:
    """One compiled configuration (``host.KernelConfig``): tile, cluster, rank, output dtype."""

    def __init__(self, cfg: KernelConfig, sm_count: int):
        self.cfg = cfg
        self.sm_count = sm_count
        self.acc_dtype = cutlass.Float32
        self.sf_dtype = layouts.SF_DTYPE
        self.ab_dtype = layouts.AB_DTYPE
        self.lr_dtype = layouts.LOWRANK_DTYPE
        self.c_dtype = layouts.out_dtype_of(cfg)
        self.use_2cta = cfg.use_2cta
        self.cta_group = tcgen05.CtaGroup.TWO if cfg.use_2cta else tcgen05.CtaGroup.ONE
        self.cluster_shape_mn = cfg.cluster_shape_mn
        self.epilog_warp_id = tuple(range(EPILOGUE_WARPS))
        self.mma_warp_id = EPILOGUE_WARPS
        self.tma_warp_id = EPILOGUE_WARPS + 1
        self.threads_per_cta = 32 * (EPILOGUE_WARPS + 2)
        self.epilog_sync_barrier = pipeline.NamedBarrier(barrier_id=1, num_threads=32 * EPILOGUE_WARPS)
        self.tmem_alloc_barrier = pipeline.NamedBarrier(barrier_id=2, num_threads=32 * (EPILOGUE_WARPS + 1))
        self.tmem = host.tmem_plan(cfg)
        self.num_acc_stage = cfg.num_acc_stage
        self.num_lr_chunks = cfg.num_lowrank_chunks

    # ------------------------------------------------------------------------------------- host

    @cute.jit
    def __call__(
        self,
        a_ptr: cute.Pointer,
        b_ptr: cute.Pointer,
        sfa_ptr: cute.Pointer,
        sfb_ptr: cute.Pointer,
        a2_ptr: cute.Pointer,
        b2_ptr: cute.Pointer,
        c_ptr: cute.Pointer,
        wcscale_ptr: cute.Pointer,
        bias_ptr: cute.Pointer,
        m: cutlass.Int32,
        n: cutlass.Int32,
        k: cutlass.Int32,
        stream: cuda.CUstream,
    ):
        cfg = self.cfg
        lay = layouts.build_layouts(cfg)
        self.lay = lay
        self.num_ab_stage = lay.num_ab_stage
        self.specs = pipeline_specs(cfg, lay.num_ab_stage)
        self.mma_tiler = lay.mma_tiler
        self.mma_tiler_sfb = lay.mma_tiler_sfb
        self.mma_tiler_lr = lay.mma_tiler_lr
        self.cta_tile_shape_mnk = lay.cta_tile_shape_mnk
        self.epi_tile = lay.epi_tile
        self.c_layout = LayoutEnum.ROW_MAJOR
        tiled_mma, tiled_mma_sfb, tiled_mma_lr = lay.tiled_mma, lay.tiled_mma_sfb, lay.tiled_mma_lr
        self.cluster_layout_vmnk = cute.tiled_divide(
            cute.make_layout((*self.cluster_shape_mn, 1)), (tiled_mma.thr_id.shape,)
        )
        self.cluster_layout_sfb_vmnk = cute.tiled_divide(
            cute.make_layout((*self.cluster_shape_mn, 1)), (tiled_mma_sfb.thr_id.shape,)
        )
        self.num_mcast_ctas_a = cute.size(self.cluster_layout_vmnk.shape[2])
        self.num_mcast_ctas_b = cute.size(self.cluster_layout_vmnk.shape[1])

        rank = cfg.rank
        n_pad = cute.round_up(n, cfg.mma_tile_n)
        # K-major global tensors with a batch mode (L = 1); M is the only dimension that varies
        # between calls of one layer, every one is runtime here (one kernel per configuration).
        a = cute.make_tensor(a_ptr, cute.make_ordered_layout((cute.assume(m, 1), cute.assume(k, 32), 1), order=(1, 0, 2)))
        b = cute.make_tensor(b_ptr, cute.make_ordered_layout((cute.assume(n, 8), cute.assume(k, 32), 1), order=(1, 0, 2)))
        sfa = cute.make_tensor(sfa_ptr, blockscaled_utils.tile_atom_to_shape_SF(a.shape, 16))
        sfb = cute.make_tensor(sfb_ptr, blockscaled_utils.tile_atom_to_shape_SF(b.shape, 16))
        a2 = cute.make_tensor(a2_ptr, cute.make_ordered_layout((m, rank, 1), order=(1, 0, 2)))
        b2 = cute.make_tensor(b2_ptr, cute.make_ordered_layout((n_pad, rank, 1), order=(1, 0, 2)))
        c = cute.make_tensor(c_ptr, cute.make_ordered_layout((m, cute.assume(n, 8), 1), order=(1, 0, 2)))
        # per-column epilogue operands as [M, N_pad] tensors with stride 0 along M
        wcs = cute.make_tensor(wcscale_ptr, cute.make_layout((m, n_pad, 1), stride=(0, 1, 0)))
        bias = cute.make_tensor(bias_ptr, cute.make_layout((m, n_pad, 1), stride=(0, 1, 0)))

        cl = self.cluster_layout_vmnk.shape
        slice0 = lambda l: cute.slice_(l, (None, None, None, 0))  # noqa: E731
        a_op = sm100_utils.cluster_shape_to_tma_atom_A(self.cluster_shape_mn, tiled_mma.thr_id)
        b_op = sm100_utils.cluster_shape_to_tma_atom_B(self.cluster_shape_mn, tiled_mma.thr_id)
        sfb_op = sm100_utils.cluster_shape_to_tma_atom_SFB(self.cluster_shape_mn, tiled_mma.thr_id)
        tma_atom_a, tma_a = cute.nvgpu.make_tiled_tma_atom_A(a_op, a, slice0(lay.a_smem), self.mma_tiler, tiled_mma, cl)
        tma_atom_b, tma_b = cute.nvgpu.make_tiled_tma_atom_B(b_op, b, slice0(lay.b_smem), self.mma_tiler, tiled_mma, cl)
        tma_atom_sfa, tma_sfa = cute.nvgpu.make_tiled_tma_atom_A(
            a_op, sfa, slice0(lay.sfa_smem), self.mma_tiler, tiled_mma, cl, internal_type=cutlass.Int16
        )
        tma_atom_sfb, tma_sfb = cute.nvgpu.make_tiled_tma_atom_B(
            sfb_op, sfb, slice0(lay.sfb_smem), self.mma_tiler_sfb, tiled_mma_sfb,
            self.cluster_layout_sfb_vmnk.shape, internal_type=cutlass.Int16,
        )
        tma_atom_a2, tma_a2 = cute.nvgpu.make_tiled_tma_atom_A(a_op, a2, slice0(lay.a2_smem), self.mma_tiler_lr, tiled_mma_lr, cl)
        tma_atom_b2, tma_b2 = cute.nvgpu.make_tiled_tma_atom_B(b_op, b2, slice0(lay.b2_smem), self.mma_tiler_lr, tiled_mma_lr, cl)
        atom_thr = cute.size(tiled_mma.thr_id.shape)
        # expect-tx bytes per stage, from the same one-stage layouts the budget used
        self.ab_tx_bytes = (
            cute.size_in_bytes(self.ab_dtype, slice0(lay.a_smem))
            + cute.size_in_bytes(self.ab_dtype, slice0(lay.b_smem))
            + cute.size_in_bytes(self.sf_dtype, slice0(lay.sfa_smem))
            + cute.size_in_bytes(self.sf_dtype, slice0(lay.sfb_smem))
        ) * atom_thr
        self.lr_tx_bytes = (
            cute.size_in_bytes(self.lr_dtype, slice0(lay.a2_smem)) + cute.size_in_bytes(self.lr_dtype, slice0(lay.b2_smem))
        ) * atom_thr
        epi_smem = cute.slice_(lay.c_smem, (None, None, 0))
        tma_atom_c, tma_c = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileS2GOp(), c, epi_smem, self.epi_tile)

        # static persistent grid: min(#tiles, SMs / cluster size) clusters, grid-stride over tiles
        num_clusters_m = cute.ceil_div(m, cfg.mma_tile_m)
        num_clusters_n = cute.ceil_div(n, cfg.mma_tile_n)
        num_tiles = num_clusters_m * num_clusters_n
        max_clusters = self.sm_count // (self.cluster_shape_mn[0] * self.cluster_shape_mn[1])
        grid_clusters = cutlass.min(num_tiles, max_clusters)

        SharedStorage = layouts.shared_storage(lay, cfg)
        self.shared_storage = SharedStorage
        if cutlass.const_expr(SharedStorage.size_in_bytes() > host.SMEM_CAPACITY_SM100):
            raise host.Sm100ConfigError(
                f"{cfg.name}: shared storage {SharedStorage.size_in_bytes()} bytes exceeds {host.SMEM_CAPACITY_SM100}"
            )

        self.kernel(
            tiled_mma, tiled_mma_sfb, tiled_mma_lr,
            tma_atom_a, tma_a, tma_atom_b, tma_b, tma_atom_sfa, tma_sfa, tma_atom_sfb, tma_sfb,
            tma_atom_a2, tma_a2, tma_atom_b2, tma_b2, tma_atom_c, tma_c, wcs, bias,
            self.cluster_layout_vmnk, self.cluster_layout_sfb_vmnk,
            lay.a_smem, lay.b_smem, lay.sfa_smem, lay.sfb_smem, lay.a2_smem, lay.b2_smem, lay.c_smem,
            self.epi_tile, num_clusters_m, num_tiles,
        ).launch(
            grid=(self.cluster_shape_mn[0], self.cluster_shape_mn[1], grid_clusters),
            block=[self.threads_per_cta, 1, 1],
            cluster=(*self.cluster_shape_mn, 1),
            stream=stream,
            min_blocks_per_mp=1,
        )

    # ------------------------------------------------------------------------------------- device

    def _state(self, name: str, role: str):
        """A pipeline state with the stage count and initial phase of ``pipeline_model``."""
        spec = self.specs[name]
        phase = spec.producer_start_phase if role == "producer" else spec.consumer_start_phase
        return pipeline.PipelineState(spec.num_stages, cutlass.Int32(0), cutlass.Int32(0), cutlass.Int32(phase))

    @cute.kernel
    def kernel(
        self,
        tiled_mma: cute.TiledMma,
        tiled_mma_sfb: cute.TiledMma,
        tiled_mma_lr: cute.TiledMma,
        tma_atom_a: cute.CopyAtom,
        mA: cute.Tensor,
        tma_atom_b: cute.CopyAtom,
        mB: cute.Tensor,
        tma_atom_sfa: cute.CopyAtom,
        mSFA: cute.Tensor,
        tma_atom_sfb: cute.CopyAtom,
        mSFB: cute.Tensor,
        tma_atom_a2: cute.CopyAtom,
        mA2: cute.Tensor,
        tma_atom_b2: cute.CopyAtom,
        mB2: cute.Tensor,
        tma_atom_c: cute.CopyAtom,
        mC: cute.Tensor,
        mWcs: cute.Tensor,
        mBias: cute.Tensor,
        cluster_layout_vmnk: cute.Layout,
        cluster_layout_sfb_vmnk: cute.Layout,
        a_smem_layout: cute.ComposedLayout,
        b_smem_layout: cute.ComposedLayout,
        sfa_smem_layout: cute.Layout,
        sfb_smem_layout: cute.Layout,
        a2_smem_layout: cute.ComposedLayout,
        b2_smem_layout: cute.ComposedLayout,
        c_smem_layout: cute.ComposedLayout,
        epi_tile: cute.Tile,
        num_clusters_m: cutlass.Int32,
        num_tiles: cutlass.Int32,
    ):
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == self.tma_warp_id:
            for atom in (tma_atom_a, tma_atom_b, tma_atom_sfa, tma_atom_sfb, tma_atom_a2, tma_atom_b2, tma_atom_c):
                cpasync.prefetch_descriptor(atom)

        n_cta = cute.size(tiled_mma.thr_id.shape)
        bidx, _, _ = cute.arch.block_idx()
        mma_tile_coord_v = bidx % n_cta
        is_leader_cta = mma_tile_coord_v == 0
        cta_rank_in_cluster = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
        cluster_coord = cluster_layout_vmnk.get_flat_coord(cta_rank_in_cluster)
        cluster_coord_sfb = cluster_layout_sfb_vmnk.get_flat_coord(cta_rank_in_cluster)
        tidx, _, _ = cute.arch.thread_idx()

        smem = utils.SmemAllocator()
        storage = smem.allocate(self.shared_storage)

        # ---- pipelines (stage counts and arrive counts from pipeline_model.pipeline_specs)
        num_tma_producer = self.num_mcast_ctas_a + self.num_mcast_ctas_b - 1
        ab_pipeline = pipeline.PipelineTmaUmma.create(
            barrier_storage=storage.ab_full.data_ptr(),
            num_stages=self.specs["ab"].num_stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, num_tma_producer),
            tx_count=self.ab_tx_bytes,
            cta_layout_vmnk=cluster_layout_vmnk,
            defer_sync=True,
        )
        lr_pipeline = pipeline.PipelineTmaUmma.create(
            barrier_storage=storage.lr_full.data_ptr(),
            num_stages=self.specs["lr"].num_stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, num_tma_producer),
            tx_count=self.lr_tx_bytes,
            cta_layout_vmnk=cluster_layout_vmnk,
            defer_sync=True,
        )
        acc_pipeline = pipeline.PipelineUmmaAsync.create(
            barrier_storage=storage.acc_full.data_ptr(),
            num_stages=self.specs["acc"].num_stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.specs["acc"].empty_arrivals),
            cta_layout_vmnk=cluster_layout_vmnk,
            defer_sync=True,
        )
        tmem = utils.TmemAllocator(
            storage.tmem_holding_buf.ptr,
            barrier_for_retrieve=self.tmem_alloc_barrier,
            allocator_warp_id=self.epilog_warp_id[0],
            is_two_cta=self.use_2cta,
            two_cta_tmem_dealloc_mbar_ptr=storage.tmem_dealloc_mbar.ptr,
        )
        pipeline_init_arrive(cluster_shape_mn=self.cluster_shape_mn, is_relaxed=True)

        sC = storage.sC.get_tensor(c_smem_layout.outer, swizzle=c_smem_layout.inner)
        sA = storage.sA.get_tensor(a_smem_layout.outer, swizzle=a_smem_layout.inner)
        sB = storage.sB.get_tensor(b_smem_layout.outer, swizzle=b_smem_layout.inner)
        sSFA = storage.sSFA.get_tensor(sfa_smem_layout)
        sSFB = storage.sSFB.get_tensor(sfb_smem_layout)
        sA2 = storage.sA2.get_tensor(a2_smem_layout.outer, swizzle=a2_smem_layout.inner)
        sB2 = storage.sB2.get_tensor(b2_smem_layout.outer, swizzle=b2_smem_layout.inner)

        # ---- global tiles, MMA partitions, TMA partitions
        tiler_a = cute.slice_(self.mma_tiler, (None, 0, None))
        tiler_b = cute.slice_(self.mma_tiler, (0, None, None))
        gA = cute.local_tile(mA, tiler_a, (None, None, None))
        gB = cute.local_tile(mB, tiler_b, (None, None, None))
        gSFA = cute.local_tile(mSFA, tiler_a, (None, None, None))
        gSFB = cute.local_tile(mSFB, cute.slice_(self.mma_tiler_sfb, (0, None, None)), (None, None, None))
        gA2 = cute.local_tile(mA2, cute.slice_(self.mma_tiler_lr, (None, 0, None)), (None, None, None))
        gB2 = cute.local_tile(mB2, cute.slice_(self.mma_tiler_lr, (0, None, None)), (None, None, None))
        tiler_c = cute.slice_(self.mma_tiler, (None, None, 0))
        gC = cute.local_tile(mC, tiler_c, (None, None, None))
        gWcs = cute.local_tile(mWcs, tiler_c, (None, None, None))
        gBias = cute.local_tile(mBias, tiler_c, (None, None, None))
        k_tile_cnt = cute.size(gA, mode=[3])

        thr_mma = tiled_mma.get_slice(mma_tile_coord_v)
        thr_mma_sfb = tiled_mma_sfb.get_slice(mma_tile_coord_v)
        thr_mma_lr = tiled_mma_lr.get_slice(mma_tile_coord_v)
        tCgA = thr_mma.partition_A(gA)
        tCgB = thr_mma.partition_B(gB)
        tCgSFA = thr_mma.partition_A(gSFA)
        tCgSFB = thr_mma_sfb.partition_B(gSFB)
        tCgA2 = thr_mma_lr.partition_A(gA2)
        tCgB2 = thr_mma_lr.partition_B(gB2)
        tCgC = thr_mma.partition_C(gC)
        tCgWcs = thr_mma.partition_C(gWcs)
        tCgBias = thr_mma.partition_C(gBias)

        a_cta_layout = cute.make_layout(cute.slice_(cluster_layout_vmnk, (0, 0, None, 0)).shape)
        b_cta_layout = cute.make_layout(cute.slice_(cluster_layout_vmnk, (0, None, 0, 0)).shape)
        sfb_cta_layout = cute.make_layout(cute.slice_(cluster_layout_sfb_vmnk, (0, None, 0, 0)).shape)
        g3 = lambda t: cute.group_modes(t, 0, 3)  # noqa: E731
        tAsA, tAgA = cpasync.tma_partition(tma_atom_a, cluster_coord[2], a_cta_layout, g3(sA), g3(tCgA))
        tBsB, tBgB = cpasync.tma_partition(tma_atom_b, cluster_coord[1], b_cta_layout, g3(sB), g3(tCgB))
        tAsSFA, tAgSFA = cpasync.tma_partition(tma_atom_sfa, cluster_coord[2], a_cta_layout, g3(sSFA), g3(tCgSFA))
        tAsSFA, tAgSFA = cute.filter_zeros(tAsSFA), cute.filter_zeros(tAgSFA)
        tBsSFB, tBgSFB = cpasync.tma_partition(tma_atom_sfb, cluster_coord_sfb[1], sfb_cta_layout, g3(sSFB), g3(tCgSFB))
        tBsSFB, tBgSFB = cute.filter_zeros(tBsSFB), cute.filter_zeros(tBgSFB)
        tAsA2, tAgA2 = cpasync.tma_partition(tma_atom_a2, cluster_coord[2], a_cta_layout, g3(sA2), g3(tCgA2))
        tBsB2, tBgB2 = cpasync.tma_partition(tma_atom_b2, cluster_coord[1], b_cta_layout, g3(sB2), g3(tCgB2))

        tCrA = tiled_mma.make_fragment_A(sA)
        tCrB = tiled_mma.make_fragment_B(sB)
        tCrA2 = tiled_mma_lr.make_fragment_A(sA2)
        tCrB2 = tiled_mma_lr.make_fragment_B(sB2)
        acc_shape = tiled_mma.partition_shape_C(self.mma_tiler[:2])
        tCtAcc_fake = tiled_mma.make_fragment_C(cute.append(acc_shape, self.num_acc_stage))

        pipeline_init_wait(cluster_shape_mn=self.cluster_shape_mn)

        if warp_idx == self.tma_warp_id:
            self.load(
                ab_pipeline, lr_pipeline, k_tile_cnt, num_clusters_m, num_tiles, cluster_layout_vmnk, cluster_coord,
                tma_atom_a, tAgA, tAsA, tma_atom_b, tBgB, tBsB, tma_atom_sfa, tAgSFA, tAsSFA,
                tma_atom_sfb, tBgSFB, tBsSFB, tma_atom_a2, tAgA2, tAsA2, tma_atom_b2, tBgB2, tBsB2,
                cluster_layout_sfb_vmnk, cluster_coord_sfb,
            )
        if warp_idx == self.mma_warp_id:
            tmem.wait_for_alloc()
            acc_tmem_ptr = tmem.retrieve_ptr(self.acc_dtype)
            self.mma(
                tiled_mma, tiled_mma_lr, ab_pipeline, lr_pipeline, acc_pipeline, acc_tmem_ptr, tCtAcc_fake,
                sSFA, sSFB, sfa_smem_layout, sfb_smem_layout, tCrA, tCrB, tCrA2, tCrB2,
                k_tile_cnt, num_tiles, is_leader_cta,
            )
        if warp_idx < self.mma_warp_id:
            tmem.allocate(self.tmem.alloc_cols)
            tmem.wait_for_alloc()
            acc_tmem_ptr = tmem.retrieve_ptr(self.acc_dtype)
            tCtAcc_base = cute.make_tensor(acc_tmem_ptr, tCtAcc_fake.layout)
            self.epilogue(
                acc_pipeline, tCtAcc_base, tCgC, tCgWcs, tCgBias, sC, tma_atom_c, epi_tile,
                tidx, warp_idx, num_clusters_m, num_tiles,
            )
            tmem.relinquish_alloc_permit()
            self.epilog_sync_barrier.arrive_and_wait()
            tmem.free(acc_tmem_ptr)

    # ---- role: TMA loads -------------------------------------------------------------------

    @cute.jit
    def load(
        self, ab_pipeline, lr_pipeline, k_tile_cnt, num_clusters_m, num_tiles, cluster_layout_vmnk, cluster_coord,
        tma_atom_a, tAgA, tAsA, tma_atom_b, tBgB, tBsB, tma_atom_sfa, tAgSFA, tAsSFA,
        tma_atom_sfb, tBgSFB, tBsSFB, tma_atom_a2, tAgA2, tAsA2, tma_atom_b2, tBgB2, tBsB2,
        cluster_layout_sfb_vmnk, cluster_coord_sfb,
    ):
        a_mask = None
        b_mask = None
        sfb_mask = None
        if cutlass.const_expr(self.use_2cta):
            a_mask = cpasync.create_tma_multicast_mask(cluster_layout_vmnk, cluster_coord, mcast_mode=2)
            b_mask = cpasync.create_tma_multicast_mask(cluster_layout_vmnk, cluster_coord, mcast_mode=1)
            sfb_mask = cpasync.create_tma_multicast_mask(cluster_layout_sfb_vmnk, cluster_coord_sfb, mcast_mode=1)
        # states live across persistent tiles: never reset (pipeline_model checks why)
        ab_state = self._state("ab", "producer")
        lr_state = self._state("lr", "producer")
        _, _, cluster_idx = cute.arch.block_idx()
        _, _, grid_clusters = cute.arch.grid_dim()
        work = cluster_idx
        while work < num_tiles:
            tile_m, tile_n = host.tile_of_work(work, num_clusters_m)
            # pipeline_model.load_order: chunk 0 first, chunk c >= 1 before K tile lowrank_load_ktile(c) (or after
            # the loop), so the loader never waits at a tile's start for the previous tile's last MMA
            lr_state = self._load_chunk(lr_pipeline, lr_state, 0, tile_m, tile_n, tma_atom_a2, tAgA2, tAsA2,
                                        tma_atom_b2, tBgB2, tBsB2, a_mask, b_mask)
            for k_tile in cutlass.range(k_tile_cnt, unroll=1):
                for chunk in cutlass.range_constexpr(1, self.num_lr_chunks):
                    if lowrank_load_ktile(chunk, k_tile_cnt, self.num_lr_chunks) == k_tile:
                        lr_state = self._load_chunk(lr_pipeline, lr_state, chunk, tile_m, tile_n, tma_atom_a2, tAgA2,
                                                    tAsA2, tma_atom_b2, tBgB2, tBsB2, a_mask, b_mask)
                ab_pipeline.producer_acquire(ab_state)
                bar = ab_pipeline.producer_get_barrier(ab_state)
                s = ab_state.index
                cute.copy(tma_atom_a, tAgA[(None, tile_m, k_tile, 0)], tAsA[(None, s)], tma_bar_ptr=bar, mcast_mask=a_mask)
                cute.copy(tma_atom_b, tBgB[(None, tile_n, k_tile, 0)], tBsB[(None, s)], tma_bar_ptr=bar, mcast_mask=b_mask)
                cute.copy(tma_atom_sfa, tAgSFA[(None, tile_m, k_tile, 0)], tAsSFA[(None, s)], tma_bar_ptr=bar, mcast_mask=a_mask)
                cute.copy(tma_atom_sfb, tBgSFB[(None, tile_n, k_tile, 0)], tBsSFB[(None, s)], tma_bar_ptr=bar, mcast_mask=sfb_mask)
                ab_state.advance()
            for chunk in cutlass.range_constexpr(1, self.num_lr_chunks):  # due past the last K tile (few K tiles)
                if lowrank_load_ktile(chunk, k_tile_cnt, self.num_lr_chunks) >= k_tile_cnt:
                    lr_state = self._load_chunk(lr_pipeline, lr_state, chunk, tile_m, tile_n, tma_atom_a2, tAgA2, tAsA2,
                                                tma_atom_b2, tBgB2, tBsB2, a_mask, b_mask)
            work += grid_clusters
        ab_pipeline.producer_tail(ab_state)
        lr_pipeline.producer_tail(lr_state)

    def _load_chunk(self, lr_pipeline, lr_state, chunk: int, tile_m, tile_n, tma_atom_a2, tAgA2, tAsA2,
                    tma_atom_b2, tBgB2, tBsB2, a_mask, b_mask):
        """TMA of low-rank chunk ``chunk`` (a Python int: traced inline) of a tile, its ``lora_act`` and
        ``proj_up`` columns, into the next ``lr`` stage; returns the advanced state."""
        lr_pipeline.producer_acquire(lr_state)
        bar = lr_pipeline.producer_get_barrier(lr_state)
        cute.copy(tma_atom_a2, tAgA2[(None, tile_m, chunk, 0)], tAsA2[(None, lr_state.index)], tma_bar_ptr=bar,
                  mcast_mask=a_mask)
        cute.copy(tma_atom_b2, tBgB2[(None, tile_n, chunk, 0)], tBsB2[(None, lr_state.index)], tma_bar_ptr=bar,
                  mcast_mask=b_mask)
        lr_state.advance()
        return lr_state

    # ---- role: MMA --------------------------------------------------------------------------

    @cute.jit
    def mma(
        self, tiled_mma, tiled_mma_lr, ab_pipeline, lr_pipeline, acc_pipeline, acc_tmem_ptr, tCtAcc_fake,
        sSFA, sSFB, sfa_smem_layout, sfb_smem_layout, tCrA, tCrB, tCrA2, tCrB2,
        k_tile_cnt, num_tiles, is_leader_cta,
    ):
        tCtAcc_base = cute.make_tensor(acc_tmem_ptr, tCtAcc_fake.layout)
        plan = self.tmem
        # TMEM column plan, checked against the layouts at trace time
        acc_cols = tcgen05.find_tmem_tensor_col_offset(tCtAcc_base)
        if cutlass.const_expr(acc_cols != plan.acc_cols):
            raise host.Sm100ConfigError(f"accumulator spans {acc_cols} TMEM columns, plan says {plan.acc_cols}")
        sfa_ptr = cute.recast_ptr(acc_tmem_ptr + plan.offsets["sfa"], dtype=self.sf_dtype)
        tCtSFA_layout = blockscaled_utils.make_tmem_layout_sfa(
            tiled_mma, self.mma_tiler, 16, cute.slice_(sfa_smem_layout, (None, None, None, 0))
        )
        tCtSFA = cute.make_tensor(sfa_ptr, tCtSFA_layout)
        sfb_ptr = cute.recast_ptr(acc_tmem_ptr + plan.offsets["sfb"], dtype=self.sf_dtype)
        tCtSFB_layout = blockscaled_utils.make_tmem_layout_sfb(
            tiled_mma, self.mma_tiler, 16, cute.slice_(sfb_smem_layout, (None, None, None, 0))
        )
        tCtSFB = cute.make_tensor(sfb_ptr, tCtSFB_layout)
        copy_sfa, tCsSFA_s2t, tCtSFA_s2t = self._s2t_copy(sSFA, tCtSFA)
        copy_sfb, tCsSFB_s2t, tCtSFB_s2t = self._s2t_copy(sSFB, tCtSFB)

        ab_state = self._state("ab", "consumer")
        lr_state = self._state("lr", "consumer")
        acc_state = self._state("acc", "producer")
        tiled_mma_lr.set(tcgen05.Field.ACCUMULATE, True)  # low-rank atoms always add
        _, _, cluster_idx = cute.arch.block_idx()
        _, _, grid_clusters = cute.arch.grid_dim()
        work = cluster_idx
        while work < num_tiles:
            tCtAcc = tCtAcc_base[(None, None, None, acc_state.index)]
            if is_leader_cta:
                acc_pipeline.producer_acquire(acc_state)
            for k_tile in cutlass.range(k_tile_cnt, unroll=1):
                if is_leader_cta:
                    ab_pipeline.consumer_wait(ab_state)
                    s2t = (None, None, None, None, ab_state.index)
                    cute.copy(copy_sfa, tCsSFA_s2t[s2t], tCtSFA_s2t)
                    cute.copy(copy_sfb, tCsSFB_s2t[s2t], tCtSFB_s2t)
                    # the tile's first K tile overwrites the accumulator, every later one adds
                    tiled_mma.set(tcgen05.Field.ACCUMULATE, k_tile != 0)
                    crd = (None, None, None, ab_state.index)
                    cute.gemm(tiled_mma, tCtAcc, [tCrA[crd], tCtSFA], [tCrB[crd], tCtSFB], tCtAcc)
                    ab_pipeline.consumer_release(ab_state)
                ab_state.advance()
                # low-rank chunks due after this K tile (pipeline_model.lowrank_issue_ktile)
                for chunk in cutlass.range_constexpr(self.num_lr_chunks):
                    if lowrank_issue_ktile(chunk, k_tile_cnt, self.num_lr_chunks) == k_tile:
                        if is_leader_cta:
                            lr_pipeline.consumer_wait(lr_state)
                            lcrd = (None, None, None, lr_state.index)
                            cute.gemm(tiled_mma_lr, tCtAcc, tCrA2[lcrd], tCrB2[lcrd], tCtAcc)
                            lr_pipeline.consumer_release(lr_state)
                        lr_state.advance()
            if is_leader_cta:
                acc_pipeline.producer_commit(acc_state)
            acc_state.advance()
            work += grid_clusters
        acc_pipeline.producer_tail(acc_state)

    def _s2t_copy(self, sSF, tSF):
        tCsSF = cute.filter_zeros(sSF)
        tCtSF = cute.filter_zeros(tSF)
        atom = cute.make_copy_atom(tcgen05.Cp4x32x128bOp(self.cta_group), self.sf_dtype)
        tiled = tcgen05.make_s2t_copy(atom, tCtSF)
        thr = tiled.get_slice(0)
        src = tcgen05.get_s2t_smem_desc_tensor(tiled, thr.partition_S(tCsSF))
        return tiled, src, thr.partition_D(tCtSF)

    # ---- role: epilogue ---------------------------------------------------------------------

    @cute.jit
    def epilogue(
        self, acc_pipeline, tCtAcc_base, tCgC, tCgWcs, tCgBias, sC, tma_atom_c, epi_tile,
        tidx, warp_idx, num_clusters_m, num_tiles,
    ):
        copy_atom_t2r = sm100_utils.get_tmem_load_op(
            self.cta_tile_shape_mnk, self.c_layout, self.c_dtype, self.acc_dtype, epi_tile, self.use_2cta
        )
        tAcc_epi = cute.flat_divide(tCtAcc_base[((None, None), 0, 0, None)], epi_tile)
        tiled_t2r = tcgen05.make_tmem_copy(copy_atom_t2r, tAcc_epi[(None, None, 0, 0, 0)])
        thr_t2r = tiled_t2r.get_slice(tidx)
        tTR_tAcc_base = thr_t2r.partition_S(tAcc_epi)
        epi_view = lambda g: cute.flat_divide(g[((None, None), 0, 0, None, None, None)], epi_tile)  # noqa: E731
        tTR_gC = thr_t2r.partition_D(epi_view(tCgC))
        tTR_gWcs = thr_t2r.partition_D(epi_view(tCgWcs))
        tTR_gBias = thr_t2r.partition_D(epi_view(tCgBias))
        frag_shape = tTR_gC[(None, None, None, 0, 0, 0, 0, 0)].shape
        tTR_rAcc = cute.make_rmem_tensor(frag_shape, self.acc_dtype)
        tTR_rWcs = cute.make_rmem_tensor(frag_shape, cutlass.Float32)
        tTR_rBias = cute.make_rmem_tensor(frag_shape, cutlass.Float32)
        tTR_rC = cute.make_rmem_tensor(frag_shape, self.c_dtype)

        copy_atom_r2s = sm100_utils.get_smem_store_op(self.c_layout, self.c_dtype, self.acc_dtype, tiled_t2r)
        tiled_r2s = cute.make_tiled_copy_D(copy_atom_r2s, tiled_t2r)
        tRS_sC = tiled_r2s.get_slice(tidx).partition_D(sC)
        tRS_rC = tiled_r2s.retile(tTR_rC)

        gC_epi = epi_view(tCgC)
        bSG_sC, bSG_gC_all = cpasync.tma_partition(
            tma_atom_c, 0, cute.make_layout(1), cute.group_modes(sC, 0, 2), cute.group_modes(gC_epi, 0, 2)
        )
        c_pipeline = pipeline.PipelineTmaStore.create(
            num_stages=layouts.NUM_C_STAGE,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 32 * EPILOGUE_WARPS),
        )
        acc_state = self._state("acc", "consumer")
        _, _, cluster_idx = cute.arch.block_idx()
        _, _, grid_clusters = cute.arch.grid_dim()
        subtile_cnt = cute.size(tTR_tAcc_base.shape, mode=[4])
        c_count = cutlass.Int32(0)  # epilogue subtiles stored so far (SMEM ring position)
        work = cluster_idx
        while work < num_tiles:
            tile_m, tile_n = host.tile_of_work(work, num_clusters_m)
            bSG_gC = cute.group_modes(bSG_gC_all[(None, None, None, tile_m, tile_n, 0)], 1, 3)
            tTR_tAcc = tTR_tAcc_base[(None, None, None, None, None, acc_state.index)]
            tTR_tAcc = cute.group_modes(tTR_tAcc, 3, cute.rank(tTR_tAcc))
            acc_pipeline.consumer_wait(acc_state)
            for sub in cutlass.range(subtile_cnt):
                cute.copy(tiled_t2r, tTR_tAcc[(None, None, None, sub)], tTR_rAcc)
                cute.autovec_copy(tTR_gWcs[(None, None, None, 0, sub, tile_m, tile_n, 0)], tTR_rWcs)
                cute.autovec_copy(tTR_gBias[(None, None, None, 0, sub, tile_m, tile_n, 0)], tTR_rBias)
                # y = acc * wcscale + bias; the low-rank term is already in acc (proj_up / wcscale)
                y = tTR_rAcc.load() * tTR_rWcs.load() + tTR_rBias.load()
                tTR_rC.store(y.to(self.c_dtype))
                buf = c_count % layouts.NUM_C_STAGE
                cute.copy(tiled_r2s, tRS_rC, tRS_sC[(None, None, None, buf)])
                cute.arch.fence_proxy("async.shared", space="cta")
                self.epilog_sync_barrier.arrive_and_wait()
                if warp_idx == self.epilog_warp_id[0]:
                    cute.copy(tma_atom_c, bSG_sC[(None, buf)], bSG_gC[(None, sub)])
                    c_pipeline.producer_commit()
                    c_pipeline.producer_acquire()
                self.epilog_sync_barrier.arrive_and_wait()
                c_count += 1
            # the whole accumulator stage has been read: hand it back to the MMA warp
            cute.arch.fence_view_async_tmem_load()
            acc_pipeline.consumer_release(acc_state)
            acc_state.advance()
            work += grid_clusters
        c_pipeline.producer_tail()


def compile_kernel(cfg: KernelConfig, arch: str = "sm_100a", sm_count: int | None = None, options: str = ""):
    """Compile one configuration for ``arch`` with fake pointers (no GPU needed). Returns the
    compiled object."""
    from cutlass.cute.runtime import make_fake_stream, make_ptr

    sm_count = sm_count or host.SM_COUNT.get(arch, 148)
    kernel = Sm100W4A4Kernel(cfg, sm_count)
    gmem = cute.AddressSpace.gmem
    ptrs = [
        make_ptr(layouts.AB_DTYPE, 0, gmem, assumed_align=32),
        make_ptr(layouts.AB_DTYPE, 0, gmem, assumed_align=32),
        make_ptr(layouts.SF_DTYPE, 0, gmem, assumed_align=32),
        make_ptr(layouts.SF_DTYPE, 0, gmem, assumed_align=32),
        make_ptr(layouts.LOWRANK_DTYPE, 0, gmem, assumed_align=16),
        make_ptr(layouts.LOWRANK_DTYPE, 0, gmem, assumed_align=16),
        make_ptr(layouts.out_dtype_of(cfg), 0, gmem, assumed_align=16),
        make_ptr(cutlass.Float32, 0, gmem, assumed_align=16),
        make_ptr(cutlass.Float32, 0, gmem, assumed_align=16),
    ]
    opts = f"--gpu-arch {arch} {options}".strip()
    return cute.compile(
        kernel, *ptrs, cutlass.Int32(0), cutlass.Int32(0), cutlass.Int32(0), make_fake_stream(), options=opts
    )
