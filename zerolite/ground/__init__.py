"""The ground every layer stands on, imported by all and importing none of them: how a
``ZEROLITE_*`` variable is read (`config_env`), the dtype names a config accepts
(`dtype_names`), the device runtime (`runtime`, the only module that calls into CUDA), the
phases announced to the memory tools (`phase_events`) and what keeps ``torch.compile`` out
of zerolite's hooks (`compile_guard`). Layer order: docs/design.md, "Layers"."""
