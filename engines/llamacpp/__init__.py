"""llama.cpp in process (llama-cpp-python), behind the harness's Backend interface."""
