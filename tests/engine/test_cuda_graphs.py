"""CUDA graphs for decode steps (engine/cuda_graphs.py): which sizes are captured, how a
step is padded to one, and that replays give the eager engine's tokens.

On CPU the one CUDA seam, the capture, is a stand-in that records the function and
re-runs it at replay: a replay then computes from the persistent buffers alone, as a
real graph does, so a step whose inputs were not copied in (or whose padding rows kept
the previous step's slots) gives other tokens. On `--device cuda` the real
`CudaGraphCapture` runs instead.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("triton", reason="triton comes with torch's CUDA build and xgrammar")

from engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from engine.attention import AttentionMetadata  # noqa: E402
from engine.cuda_graphs import (  # noqa: E402
    CudaGraphCapture,
    CudaGraphRunner,
    DecodeBuffers,
    capture_sizes,
)
from engine.execution_plan import ModelShape, graphs_off_reason, resolve_attention  # noqa: E402
from scheduler import ScheduledRequest  # noqa: E402
from tests.engine.tiny_models import make_tiny_model_dir  # noqa: E402

pytestmark = pytest.mark.device


class RerunCapture:
    """A capture that keeps the function: each replay runs it again and writes the result
    into the tensor the capture returned, as a graph's replay does."""

    def __init__(self) -> None:
        self.captured: list[int] = []  # batch sizes, in capture order
        self.replays: list[int] = []

    def __call__(self, fn):
        out = fn()
        size = out.shape[0]
        self.captured.append(size)

        def replay() -> None:
            self.replays.append(size)
            out.copy_(fn())

        return replay, out


def test_capture_sizes():
    assert capture_sizes(256) == [1, 2, 4, 8, *range(16, 257, 16)]
    assert capture_sizes(100) == [1, 2, 4, 8, *range(16, 97, 16), 100]
    assert capture_sizes(3) == [1, 2, 3]
    assert capture_sizes(1) == [1]
    assert capture_sizes(4096)[-1] == 512  # larger batches run eagerly


def test_graphs_off_reason():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert graphs_off_reason(cuda, False, "triton", 1) is None
    assert graphs_off_reason(cpu, False, "triton", 1) == "not on CUDA"
    assert graphs_off_reason(cuda, True, "triton", 1) == "--enforce-eager"
    assert "attention backend" in graphs_off_reason(cuda, False, "sdpa", 1)
    assert graphs_off_reason(cuda, False, "triton", 2) == "tensor parallelism"


def test_auto_is_triton_on_cuda_where_it_applies():
    def on_cuda(**fields) -> str:
        config, shape = EngineConfig(**fields), ModelShape(4, 2, 16, silu=True)
        return resolve_attention(config, torch.device("cuda"), torch.float32, None, shape)

    assert on_cuda() == "triton"
    assert on_cuda(block_size=8) == "triton"  # its key tiles span several small blocks
    assert on_cuda(kv_cache_dtype="int8") == "sdpa"  # triton reads no int8 rows
    assert on_cuda(attention_backend="sdpa") == "sdpa"  # asked for


def decodes(seq_lens: list[int], block_size: int = 16) -> list[ScheduledRequest]:
    """A decode step: request r holds seq_lens[r] tokens after it, in blocks 10 + 4r, ..."""
    return [
        ScheduledRequest(None, str(r), [100 + r], s - 1,
                         tuple(10 + r * 4 + b for b in range(-(-s // block_size))), True)
        for r, s in enumerate(seq_lens)
    ]  # fmt: skip


def test_a_step_is_copied_in_and_padded_to_its_size():
    buffers = DecodeBuffers(8, max_blocks=4, device=torch.device("cpu"))
    buffers.load(decodes([40, 17, 33, 5]), size=4, block_size=16)
    small = decodes([41, 18, 34])  # one request finished: row 3 now pads
    buffers.load(small, size=4, block_size=16)
    want = AttentionMetadata.build([1] * 3, [41, 18, 34], [s.block_ids for s in small], 16, "cpu")
    assert buffers.input_ids[:4].tolist() == [100, 101, 102, 0]
    assert buffers.positions[:4].tolist() == [40, 17, 33, 0]
    assert buffers.seq_lens[:4].tolist() == [41, 18, 34, 0]  # a padding row reads nothing
    assert buffers.slot_mapping[:4].tolist() == [*want.slot_mapping.tolist(), -1]  # writes nothing
    assert buffers.block_tables[:3, :3].tolist() == want.block_tables.tolist()
    assert buffers.slot_mapping[4:].tolist() == [-1] * 4  # never written: never loaded


def test_a_request_rebuilt_elsewhere_is_written_whole_when_it_returns_to_its_row():
    # CI's hypothesis find: "3" decodes in row 1, is preempted and admitted again (a new
    # table of the same length) while decoding in row 0, then returns to row 1 with no new
    # blocks. Its length and request id match what row 1 holds; its blocks do not.
    buffers = DecodeBuffers(2, max_blocks=4, device=torch.device("cpu"))
    old, rebuilt = (60, 61), (60, 99)  # the first block a prefix-cache hit
    other = ScheduledRequest(None, "x", [7], 20, (5, 6), True)
    buffers.load([other, ScheduledRequest(None, "3", [7], 20, old, True)], 2, 16)
    buffers.load([ScheduledRequest(None, "3", [7], 20, rebuilt, True, 1)], 2, 16)
    buffers.load([other, ScheduledRequest(None, "3", [7], 21, rebuilt, True)], 2, 16)
    assert buffers.block_tables[1, :2].tolist() == list(rebuilt)


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_the_tables_written_are_the_requests_whatever_changed(data):
    # A step writes only the rows whose table changed (`DecodeBuffers._rows`): requests that
    # move to other rows, grow by this step's blocks, grow in steps the graphs did not run
    # (eager ones), or are rebuilt after preemption. The buffers must hold every table.
    buffers = DecodeBuffers(4, max_blocks=12, device=torch.device("cpu"))
    tables = {str(r): (r * 20,) for r in range(6)}
    counter = iter(range(1000, 100000))
    for _ in range(data.draw(st.integers(1, 8))):
        ids = data.draw(st.lists(st.sampled_from(sorted(tables)), min_size=1, max_size=4,
                                 unique=True))  # fmt: skip
        step = []
        for rid in ids:
            change = data.draw(st.sampled_from(["same", "grow", "unseen", "rebuilt"]))
            old = tables[rid]
            new_blocks = 0
            if change == "grow" and len(old) < 12:  # blocks added this step
                tables[rid] = old + (next(counter),)
                new_blocks = 1
            elif change == "unseen" and len(old) < 11:  # added in a step run eagerly
                tables[rid] = old + (next(counter), next(counter))
            elif change == "rebuilt":  # preempted and admitted again, its prefix cached
                tables[rid] = old[:-1] + (next(counter),)
                new_blocks = 1
            table = tables[rid]
            step.append(ScheduledRequest(None, rid, [7], len(table) * 16 - 1, table, True,
                                         new_blocks))  # fmt: skip
        buffers.load(step, size=4, block_size=16)
        for row, s in enumerate(step):
            assert buffers.block_tables[row, : len(s.block_ids)].tolist() == list(s.block_ids)


def test_graph_size_is_the_next_captured_size_for_decode_only_steps(model_dir, device):
    # On the test's device: a CPU engine's Triton kernels run only under the interpreter,
    # which `--device cuda` does not turn on (the first GPU run found this test on CPU).
    engine = tiny_engine(model_dir, device, max_num_seqs=6)
    graphs = CudaGraphRunner(engine.core.model, engine.core.runner.kv_caches, 16, 128, 6,
                             device)  # fmt: skip
    assert graphs.graph_size(decodes([5])) is None  # nothing captured yet
    capture = RerunCapture()
    graphs.capture(capture)
    assert capture.captured == [6, 4, 2, 1]  # largest first: the pool's order
    assert graphs.graph_size(decodes([5] * 3)) == 4
    assert graphs.graph_size(decodes([5] * 6)) == 6
    prefill = ScheduledRequest(None, "p", [1, 2, 3, 4], 0, (7,), True)
    assert graphs.graph_size([*decodes([9]), prefill]) is None  # a prefill in the step: eager
    assert graphs.graph_size(decodes([5] * 7)) is None  # above the largest: eager
    assert graphs.graph_size(decodes([129])) is None  # a table longer than the buffers'


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def eager(model_dir, device) -> dict[str, list[int]]:
    return greedy_run(tiny_engine(model_dir, device, enforce_eager=True))


def tiny_engine(model_dir, device="cpu", **overrides) -> LLMEngine:
    config = dict(model=str(model_dir), dtype="float32", device=str(device), num_blocks=64,
                  attention_backend="triton", max_num_batched_tokens=64)  # fmt: skip
    return LLMEngine(EngineConfig(**{**config, **overrides}))


def greedy_run(engine: LLMEngine) -> dict[str, list[int]]:
    """Requests of different lengths arriving at different steps, so decode batches grow
    and shrink (padding rows that held a finished request's slot) and a prefix is hit."""
    prompts = {"a": [5, 6, 7] * 7, "b": [5, 6, 7] * 7 + [9, 10], "c": [11] * 40, "d": [3, 4]}
    max_tokens = {"a": 9, "b": 4, "c": 12, "d": 7}
    later = ["d"]
    done: dict[str, list[int]] = {}
    for rid in ("a", "b", "c"):
        engine.add_request(
            rid, prompts[rid], SamplingParams(max_tokens=max_tokens[rid], temperature=0.0)
        )
    steps = 0
    while engine.has_unfinished_requests() or later:
        steps += 1
        if steps == 5 and later:
            rid = later.pop()
            engine.add_request(
                rid, prompts[rid], SamplingParams(max_tokens=max_tokens[rid], temperature=0.0)
            )
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.token_ids
    kv = engine.core.kv_cache_manager
    kv.check_invariants()
    assert kv.num_free_blocks == engine.core.num_blocks  # every request returned its blocks
    return done


def test_replayed_decodes_give_the_eager_tokens(model_dir, eager, device):
    engine = tiny_engine(model_dir, device, max_num_seqs=4)
    if device.type == "cuda":
        assert engine.core.runner.graphs is not None  # captured by the engine at start-up
        assert "CUDA graphs for decode batches 1..4" in engine.core.compute_summary
        assert greedy_run(engine) == eager
        return
    assert engine.core.runner.graphs is None  # CPU: never captured by the engine itself
    graphs = CudaGraphRunner(engine.core.model, engine.core.runner.kv_caches, 16,
                             engine.core.max_model_len, 4, device)  # fmt: skip
    capture = RerunCapture()
    graphs.capture(capture)
    engine.core.runner.graphs = graphs
    assert greedy_run(engine) == eager
    # Decode steps of 3 and 2 requests replayed padded to 4 and 2; of 1 at 1.
    assert {4, 2, 1} <= set(capture.replays)


def capture_for(device: torch.device):
    """The real capture on CUDA; the re-running stand-in elsewhere."""
    return CudaGraphCapture() if device.type == "cuda" else RerunCapture()


def test_a_replay_reads_only_the_buffers(model_dir, eager, device):
    # Without the copy into the buffers, a replay recomputes the capture's inputs: the
    # tokens differ from the eager ones (on CPU this guards the stand-in capture itself).
    engine = tiny_engine(model_dir, device, max_num_seqs=4)
    graphs = CudaGraphRunner(engine.core.model, engine.core.runner.kv_caches, 16,
                             engine.core.max_model_len, 4, device)  # fmt: skip
    graphs.capture(capture_for(device))
    graphs.buffers.load = lambda *args: None
    engine.core.runner.graphs = graphs
    assert greedy_run(engine) != eager


def test_a_capture_replays_over_new_inputs(device):
    # The capture's contract (real on CUDA, the stand-in elsewhere): replay computes the
    # captured function again from its input's current contents, into the same tensor.
    x = torch.arange(4.0, device=device)
    replay, out = capture_for(device)(lambda: x * 2)
    x.copy_(torch.tensor([5.0, 6.0, 7.0, 8.0], device=device))
    replay()
    assert out.tolist() == [10.0, 12.0, 14.0, 16.0]


def test_replays_through_preemption_give_the_eager_tokens(model_dir, device):
    # Too few blocks for every request: a request is preempted mid-decode, admitted again
    # with a new table and replayed again, in a row another request's table held.
    def run(**overrides) -> dict[str, list[int]]:
        engine = tiny_engine(model_dir, device, max_num_seqs=4, block_size=4, num_blocks=16,
                             max_num_batched_tokens=16, **overrides)  # fmt: skip
        capture = None
        if device.type != "cuda" and not overrides:
            engine.core.runner.graphs = CudaGraphRunner(engine.core.model, engine.core.runner.kv_caches,
                                                   4, engine.core.max_model_len, 4, device)  # fmt: skip
            capture = RerunCapture()
            engine.core.runner.graphs.capture(capture)
        done = greedy_run(engine)
        assert engine.core.scheduler.num_preemptions > 0
        assert capture is None or capture.replays
        return done

    assert run() == run(enforce_eager=True)
