"""The 'library' this plugin patches: a function with a known bug."""


def horizon(mask_len: int, action_horizon: int) -> int:
    return mask_len  # bug: should be clipped to action_horizon
