"""The tiers every loaded model shares: device memory, RAM and the SSD, one residency directory, one lock."""
