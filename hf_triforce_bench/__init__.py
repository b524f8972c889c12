"""The measurement bench beside `hf_triforce`: decode speed of each method against plain decoding (`compare`,
`hf-triforce-bench decode`), the retrieval needle (`needle`), the roofline projection (`roofline`,
`hf-triforce-bench project`), other engines as peers (`llama_cpp_engine`, `peer_process`), and `hf-triforce serve`
in a child process (`server_process`, for the serving tests and `benchmarks/serve_load.py`). It imports
`hf_triforce`; `hf_triforce` never imports it."""
