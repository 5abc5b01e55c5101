"""The simulated engine and process orchestration behind `kvsvc demo`."""
