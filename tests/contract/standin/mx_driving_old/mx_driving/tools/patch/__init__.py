"""Pre-1.0 layout: Patcher().add(TransformersNPU).apply(); no default_patcher_builder."""
import mx_driving


class TransformersNPU:
    pass


class Patcher:
    def add(self, patch):
        mx_driving.CALLS.append(f"Patcher().add({patch.__name__})")
        return self

    def apply(self):
        mx_driving.CALLS.append("apply()")
        return self
