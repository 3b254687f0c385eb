"""benchmarks/gpu_gaps.py on a hand-made trace: which gaps are the host's, and where it was."""
import json

from benchmarks.gpu_gaps import idle_report


def _trace(tmp_path, events):
    p = tmp_path / "trace.json"
    p.write_text(json.dumps({"traceEvents": events}))
    return str(p)


def test_gaps_are_split_into_host_late_and_device_side_and_attributed(tmp_path):
    ev = [
        # kernel 1 0-100, kernel 2 launched at 150 (after kernel 1 ended: host-late gap 100-200),
        # kernel 3 launched at 120 (in time) but starts at 230 (device-side gap 220-230).
        {"cat": "kernel", "name": "k1", "ts": 0, "dur": 100, "args": {"correlation": 1}},
        {"cat": "kernel", "name": "k2", "ts": 200, "dur": 20, "args": {"correlation": 2}},
        {"cat": "kernel", "name": "k3", "ts": 230, "dur": 10, "args": {"correlation": 3}},
        {"cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": -5, "dur": 3, "tid": 7, "args": {"correlation": 1}},
        {"cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 147, "dur": 3, "tid": 7, "args": {"correlation": 2}},
        {"cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 117, "dur": 3, "tid": 7, "args": {"correlation": 3}},
        {"cat": "python_function", "name": "src/conveyor/trainer/single.py(452): _backward", "ts": -10, "dur": 400,
         "tid": 7},
        {"cat": "python_function", "name": "src/conveyor/trainer/packing.py(88): layout", "ts": 101, "dur": 45,
         "tid": 7},
        {"cat": "python_function", "name": "torch/nn/modules/module.py(1): _call_impl", "ts": 140, "dur": 9, "tid": 7},
        {"cat": "cpu_op", "name": "aten::item", "ts": 105, "dur": 40, "tid": 7},
    ]
    report = idle_report(_trace(tmp_path, ev), min_us=5)
    head, _, rows = report.split("\n", 2)
    assert "busy 0.1 ms" in head and "host-late 0.1 ms" in head and "device-side 0.0 ms" in head
    # The one host-late gap (100 us, middle at 150) is charged to the innermost conveyor frame there
    # (_backward: packing.layout ended at 146) and the innermost operator (none at 150).
    assert rows.splitlines()[0].split() == ["0.10", "1", "trainer/single.py:452", "_backward", "|", "-"]


def test_a_gap_inside_a_conveyor_frame_names_it_and_the_operator(tmp_path):
    ev = [
        {"cat": "kernel", "name": "k1", "ts": 0, "dur": 10, "args": {"correlation": 1}},
        {"cat": "kernel", "name": "k2", "ts": 60, "dur": 10, "args": {"correlation": 2}},
        {"cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 50, "dur": 2, "tid": 1, "args": {"correlation": 2}},
        {"cat": "python_function", "name": "src/conveyor/controller/objective.py(222): __call__", "ts": 12,
         "dur": 40, "tid": 1},
        {"cat": "cpu_op", "name": "aten::_local_scalar_dense", "ts": 20, "dur": 25, "tid": 1},
    ]
    rows = idle_report(_trace(tmp_path, ev)).splitlines()[2:]
    assert rows == ["    0.05      1  controller/objective.py:222 __call__ | aten::_local_scalar_dense"]


def test_a_trace_without_device_events_says_so(tmp_path):
    assert idle_report(_trace(tmp_path, [{"cat": "cpu_op", "name": "x", "ts": 0, "dur": 1}])) == \
        "no device events in the trace"
