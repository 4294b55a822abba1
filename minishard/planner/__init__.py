"""The planner: memory and time of a strategy before any rank runs.

    analytic.py             the ledger's formulas (parameters, gradients, optimizer state, activations)
    costmodel.py            memory and step time of every strategy on a cluster; the best plan
    advice.py               what to change when a plan does not fit
    deepspeed_estimator.py  DeepSpeed's own estimator, for comparison
    links.py                bytes a collective sends over each link
"""
