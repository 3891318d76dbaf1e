"""New layout: TransformersNPU is gone (importing it fails as in field report 001, pitfall 7.2)."""
