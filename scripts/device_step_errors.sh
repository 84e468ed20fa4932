# Runs the error tests one by one, verbosely, with faulthandler (a crash names the test).
python3 -X faulthandler -m pytest -v -p no:cacheprovider tests/test_ops_errors.py 2>&1 | grep -vE "^\s+File \"/opt" | tail -80
