"""SPIR-V code generation for the Vulkan backend: `builder` (module, ids, types,
constants, instruction words), `writer` (kernel IR -> module), `strategy` (which way a
kernel is spread over workgroups)."""
