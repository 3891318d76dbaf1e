"""Where a diffusers model's weights go once it is built on meta and checked.

- :mod:`zero3`: straight into ZeRO-3 partitions (zero3_init_flag), read once by rank 0;
- :mod:`fsdp`: left empty on the ranks FSDP's prepare fills from rank 0 (cpu_ram_efficient_loading);
- :mod:`local`: read on this rank, at most K ranks of a node at once (load slots), cast in threads.
"""
