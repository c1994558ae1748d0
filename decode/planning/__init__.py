"""Plan each method's tree from measurements on this device (Sequoia, Chen et al. 2024).

    shapes      acceptance rates per depth and rank, and the best static tree under them
    replay      a drafter replayed along the oracle's greedy outputs, and the speed it forecasts
    costs       the oracle's forward cost per node count on this device (cached)
    plan_file   RUN/plan.json: each method's best policy, and what it was measured with
"""
