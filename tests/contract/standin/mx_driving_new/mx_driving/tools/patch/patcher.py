import mx_driving


class _Patcher:
    def __enter__(self):
        mx_driving.CALLS.append("default_patcher_builder.build().__enter__()")
        return self

    def __exit__(self, *exc):
        mx_driving.CALLS.append("__exit__")


class _Builder:
    def build(self):
        mx_driving.CALLS.append("default_patcher_builder.build()")
        return _Patcher()


default_patcher_builder = _Builder()
