"""Which captured decode graph a batch replays: the batch-size buckets and, for small batches,
the context bounds (host-side choices; the graphs themselves are tests/worker/test_gpu_runner's)."""

from echo.worker.cuda_graphs import CudaGraphRunner, bucket_sizes, context_bounds


def test_sizes_and_bounds():
    assert bucket_sizes(40) == [1, 2, 4, 8, 16, 24, 32, 40]
    assert context_bounds(1, 4096) == [256, 512, 1024, 2048, 4096]
    assert context_bounds(8, 3000) == [256, 512, 1024, 2048, 3000]
    assert context_bounds(16, 4096) == [4096]  # large batches fill the GPU without splits
    assert context_bounds(2, 200) == [200]


def test_key_for_takes_the_smallest_graph_that_holds_the_batch():
    graphs = CudaGraphRunner(None, None, [], None, max_num_seqs=16, max_model_len=4096)
    assert graphs.key_for(1, 256) == (1, 256)
    assert graphs.key_for(3, 257) == (4, 512)
    assert graphs.key_for(8, 4096) == (8, 4096)
    assert graphs.key_for(9, 10) == (16, 4096)
    assert graphs.key_for(17, 10) is None
    # captured largest first, each size's bounds largest first
    assert graphs.keys[:3] == [(16, 4096), (8, 4096), (8, 2048)] and graphs.keys[-1] == (1, 256)
    assert len(graphs.keys) == 1 + 4 * 5
