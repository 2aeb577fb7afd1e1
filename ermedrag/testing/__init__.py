"""Test doubles and local test servers, shipped with the package so that tests and benches share them.

- `tiny_model`: a tiny randomly initialised causal LM with a real tokenizer (training-loop tests)
- `scripted`: scripted reply functions for graph-wiring tests (`scripted:ermedrag.testing.scripted`, and its
  variants `scripted:ermedrag.testing.scripted.<name>`)
- `misbehaving_server`: an OpenAI-compatible server that fails on purpose, one way per mode
- `real_servers`: real OpenAI-compatible servers (llama.cpp's, `transformers serve`) with the offline model
- `llamacpp_server`: llama.cpp's own server with the offline model's chat format
- `processes`: free ports, log tails, stopping a server's process group
"""
