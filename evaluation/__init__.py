"""The evaluation harness: datasets (variable tracking included), metrics, the resumable runner (`nodekv eval`), its
run files and report, the index store, Ray tasks, corpus indexing and PECAN's t_p calibration. It reaches methods
through their registry (`nodekv.methods.get`); no method imports it."""
