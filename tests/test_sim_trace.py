"""Chrome trace export and PNG plots."""
import json
import sys

import pytest

from fxdream.sim import DepKind, Task, TaskGraph, plot_comparison, plot_timeline, simulate, to_chrome_trace, write_chrome_trace


def two_stream_graph():
    g = TaskGraph()
    g.append(Task.cpu("L1", 1, op="launch"))
    g.append(Task.gpu("K1", 10, layer="conv1", op="aten.convolution", fx_node="conv",
                      mem_alloc=4096), deps=["L1"])
    g.append(Task.cpu("L2", 1, thread=1))
    g.append(Task.gpu("K2", 5, stream=1, layer="fc", op="aten.mm", mem_free=4096),
             deps=["L2", ("K1", DepKind.EVENT)])
    g.append(Task.comm("AR", 3), deps=["K2"])
    return g


def test_chrome_trace_is_valid_json_with_one_named_track_per_resource(tmp_path):
    g = two_stream_graph()
    tl = simulate(g)
    path = write_chrome_trace(g, tl, tmp_path / "t.trace.json")
    data = json.loads(open(path).read())
    ev = data["traceEvents"]
    names = {e["args"]["name"]: (e["pid"], e["tid"]) for e in ev if e["name"] == "thread_name"}
    assert set(names) == {"cpu:0", "cpu:1", "stream:0", "stream:1", "comm:0"}
    assert len(set(names.values())) == 5                       # distinct tracks
    x = {e["args"]["task"]: e for e in ev if e["ph"] == "X"}
    assert set(x) == set(g.names)
    # K1: L1 0-1 launches it, 1-11; K2 waits for the event: 11-16; AR 16-19
    assert (x["K1"]["ts"], x["K1"]["dur"]) == (1.0, 10.0)
    assert (x["K2"]["ts"], x["K2"]["dur"]) == (11.0, 5.0)
    assert (x["K1"]["pid"], x["K1"]["tid"]) == names["stream:0"]
    assert x["K1"]["args"]["layer"] == "conv1" and x["K1"]["args"]["fx_node"] == "conv"
    assert x["K1"]["name"] == "aten.convolution"
    flows = [e for e in ev if e["ph"] in "sf"]
    assert len(flows) == 2 * 2                                 # two LAUNCH edges, s + f each
    mem = [e["args"]["bytes"] for e in ev if e["ph"] == "C"]
    assert max(mem) == 4096
    assert data["otherData"]["makespan_us"] == 19.0


def test_to_chrome_trace_round_trips_through_json():
    g = two_stream_graph()
    d = to_chrome_trace(g, simulate(g))
    assert json.loads(json.dumps(d)) == d


def test_plot_timeline_and_comparison_write_png(tmp_path):
    pytest.importorskip("matplotlib")
    g = two_stream_graph()
    tl = simulate(g)
    p = plot_timeline(g, tl, tmp_path / "t.png", title="two streams", color_by="layer")
    assert open(p, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    h = g.scale(g.select(kind="gpu"), 0.5)
    p2 = plot_comparison((g, tl), (h, simulate(h)), tmp_path / "c.png", title="GPU 2x")
    assert open(p2, "rb").read(4) == b"\x89PNG"


def test_plot_without_matplotlib_says_how_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    monkeypatch.setitem(sys.modules, "matplotlib.backends.backend_agg", None)
    g = two_stream_graph()
    with pytest.raises(ImportError, match="pip install matplotlib"):
        plot_timeline(g, simulate(g), tmp_path / "t.png")
