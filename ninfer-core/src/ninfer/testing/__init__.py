"""Conformance kit for architecture plugins (ours and third parties').

Use it from a plugin's own tests::

    from ninfer.testing import check_plugin_module, check_architecture
    def test_conformance():
        check_plugin_module("my_plugin.plugin")
        check_architecture("my_arch", sample_config={...})
"""

from ninfer.testing.conformance import (
    ConformanceError,
    check_architecture,
    check_plugin_module,
)

__all__ = ["ConformanceError", "check_architecture", "check_plugin_module"]
