"""How blocks of tensors travel between ranks: their frames on the wire (`wire`), the links and the
mailbox of a ring (`ring`), shared memory between ranks on one host (`shm`) and an mx.distributed
group (`data_plane`). What the blocks mean is the ring algorithms' business (cpchat.rank.algorithms)."""
