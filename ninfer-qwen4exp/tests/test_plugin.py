from ninfer.plugins import make_plugin_host


def test_qwen4exp_registers_its_architecture():
    host = make_plugin_host(strict=True)
    assert "qwen4exp" in {p.name for p in host.loaded}
    arch = host.architecture("Qwen4ExpForCausalLM")
    assert arch.spec.name == "qwen4exp"
    assert host.architecture("Qwen4ExpForConditionalGeneration").spec.name == "qwen4exp"
    assert arch.spec.source_mapping == "ninfer_qwen4exp.source_mapping:source_mapping"
    assert arch.spec.startup == "ninfer_qwen4exp.startup:Qwen4ExpStartup"
    assert callable(arch.spec.load("source_mapping"))
