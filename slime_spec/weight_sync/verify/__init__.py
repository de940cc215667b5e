"""What a sync verifies: coverage, SGLang's checksums, values read back, the acceptance canary."""
