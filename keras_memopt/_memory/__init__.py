"""Reading memory: the allocator's figures, byte sizes, and `MemoryLogger`'s outputs."""
