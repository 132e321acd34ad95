"""The students: the transformers student on one process or under DDP (`hf`), sharded with FSDP2
(`fsdp`), megatron-core's GPTModel at any tp × pp × dp (`megatron`), and the process groups of a run
(`groups`). The only place that knows which backend runs."""
