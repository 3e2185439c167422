\set account random(0, 999)
BEGIN;
INSERT INTO bench_events (account, amount) VALUES (:account, 1);
UPDATE bench_accounts SET balance = balance + 1 WHERE id = :account;
COMMIT;
