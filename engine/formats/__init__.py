"""Weight formats the engine stores experts in: int8, int4 and the checkpoints' own (MXFP4)."""
