from ninfer.plugins import make_plugin_host


def test_qwen4exp_registers_nothing_until_implemented():
    host = make_plugin_host(strict=True)
    assert "qwen4exp" in {p.name for p in host.loaded}
    assert not any("Qwen4Exp" in h for a in host.architectures().values() for h in a.spec.handles)
