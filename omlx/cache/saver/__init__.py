"""Storing blocks: made from a finished prefill or sequence, put into device memory, written back to the SSD."""
