"""The measurement bench beside `hf_triforce`: decode speed of each method against plain decoding (`compare`,
`hf-triforce-bench decode`), the retrieval needle (`needle`), the roofline projection (`roofline`,
`hf-triforce-bench project`), and other engines as peers (`llama_cpp_engine`, `peer_process`). It imports
`hf_triforce`; `hf_triforce` never imports it."""
