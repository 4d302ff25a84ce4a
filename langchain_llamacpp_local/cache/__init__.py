"""What the KV cache keeps between requests: slots and prefixes, prompt cuts,
checkpoints, the host-RAM and disk prompt caches; the slot decision
(:mod:`slot_plan`, pure) and the mechanism that applies it (:mod:`slot_memory`).
"""
