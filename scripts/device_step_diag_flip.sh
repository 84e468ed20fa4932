# Diagnosis of a failing GPU greedy-generate test: scripts/diag_greedy_flip.py for DIAG_SEED / DIAG_FAMILY
# (default: the seed and family that failed on the device in session 8).
timeout ${DIAG_TIMEOUT:-150} python3 scripts/diag_greedy_flip.py --seed ${DIAG_SEED:-769923218} \
    --family ${DIAG_FAMILY:-deepseek_v3} --variants ${DIAG_VARIANTS:-ktorch_graphs,ktorch} 2>&1 \
    | grep -vE "^W1|Warning|warn"
